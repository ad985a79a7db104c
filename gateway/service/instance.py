"""The gateway service: what one gateway instance holds (Redis, its reply dispatcher and producer, the
model's tokenizer, metrics) and does (tokenize, admit, send, cancel, find live workers).

Prompts are tokenized here, once: the gateway needs the token count anyway (a prompt longer than
the model's context is a 400 before it queues), and workers receive ``prompt_token_ids``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import structlog
from jinja2 import TemplateError
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from pagedserve.gateway.bodies.parse import ApiError, Limits, ParsedRequest
from pagedserve.gateway.dashboard.hub import DashboardHub
from pagedserve.gateway.routing.router import Router, RoutingPolicy
from pagedserve.gateway.routing.worker_directory import WorkerDirectory, Workers
from pagedserve.gateway.service.metrics import GatewayMetrics
from pagedserve.gateway.service.openapi import openapi_spec
from pagedserve.gateway.service.settings import GatewaySettings
from pagedserve.runtime.outage import Outage
from pagedserve.runtime.producer import Producer, QueueLimit
from pagedserve.runtime.redis_client import connect
from pagedserve.runtime.redis_io import stop_tasks
from pagedserve.runtime.replies import ReplyDispatcher
from pagedserve.runtime.structured_grammar import check_structured
from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.keys import Keys
from pagedserve.shared.prompts import check_token_ids, encode_chat
from pagedserve.shared.protocol import ReplyTarget, WireRequest
from pagedserve.shared.sampling_defaults import generation_defaults

log = structlog.get_logger("pagedserve.gateway")


class GatewayService:
    def __init__(self, settings: GatewaySettings) -> None:
        from transformers import AutoTokenizer

        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.tokenizer = AutoTokenizer.from_pretrained(settings.model)
        self.sampling_defaults = generation_defaults(settings.model, settings.generation_config)
        log.info("sampling defaults for unset request fields", source=settings.generation_config,
                 defaults=self.sampling_defaults or "none")
        self.limits = Limits(max_n=settings.max_n, max_tokens=settings.max_tokens,
                             default_chat_max_tokens=settings.default_chat_max_tokens)
        self.openapi = openapi_spec(len(self.tokenizer), self.limits, self.settings.served_model_name)
        # Blocking pool: a burst of requests waits for a connection instead of failing. Pooled
        # connections that died with a Redis restart are retried on a fresh one, not turned into 503s.
        self.redis = connect(settings.redis_url, blocking_pool=True, max_connections=64, timeout=30,
                             retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 3),
                             retry_on_error=[RedisConnectionError])
        self.producer = Producer(self.redis, self.keys)
        self.admitting = 0  # entries between their admission check and their add to a stream (``admission``)
        self.dispatcher = ReplyDispatcher(self.redis, self.keys.replies(settings.gateway_id), self.producer,
                                          outage=Outage(settings.outage_grace_s))
        self._tokenizing = ThreadPoolExecutor(2, thread_name_prefix="tokenize")
        self.metrics = GatewayMetrics(self.redis, self.keys, settings.served_model_name)
        self.metrics.open_requests.set_function(lambda: self.dispatcher.open_count)
        policy = RoutingPolicy(settings.routing, settings.routing_load_weight, busy_waiting=settings.routing_busy_waiting,
                               imbalance=settings.routing_imbalance)
        self.dashboard = DashboardHub(self.redis, self.keys, settings.served_model_name, self.metrics.recent)
        self.workers = WorkerDirectory(self.redis, self.keys)
        self.router = Router(self.workers, self.keys, settings.served_model_name, policy)
        self._index_task: asyncio.Task | None = None
        self._index_stop = asyncio.Event()
        self._ignored_seen: set[str] = set()

    def note_ignored(self, fields: tuple[str, ...]) -> None:
        """Log request fields accepted without effect, once per name (as vLLM warns of extra fields)."""
        new = [f for f in fields if f not in self._ignored_seen]
        if new and len(self._ignored_seen) < 1000:  # bounded: arbitrary clients must not grow this forever
            self._ignored_seen.update(new)
            log.warning("request fields ignored (not supported; logged once per name)", fields=[f[:64] for f in new[:20]])

    async def start(self) -> None:
        await self.dispatcher.start(wait=False)  # Redis may be down now: serve 503s until it is back
        if self.settings.routing == "prefix":
            # Its own connection: the index's blocking XREAD holds one a quarter of a second at a time.
            self._index_redis = connect(self.settings.redis_url)
            self._index_task = asyncio.create_task(self.router.index.follow(
                self._index_redis, self.keys.kv_events(self.settings.served_model_name), self._index_stop))

    async def close(self) -> None:
        if self._index_task is not None:
            await stop_tasks([self._index_task], self._index_stop)
            await self._index_redis.aclose()
        await self.dispatcher.stop()
        await self.redis.aclose()
        self._tokenizing.shutdown(wait=False)

    # ------------------------------------------------------------------ prompts
    async def prompt_ids(self, parsed: ParsedRequest) -> list[list[int]]:
        """Token ids of every prompt, checked against the live workers' context and vocabulary (so
        a prompt no worker can take is a 400 here, not an error from a worker). Tokenizing runs on
        a thread: a megabyte prompt must not stall every other stream on the event loop."""
        live = await self.workers.workers(self.settings.served_model_name)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, self._prompt_ids, parsed, live)

    async def context_limit(self) -> int | None:
        """The smallest ``max_model_len`` of the live workers (None with none: a request is a 503 then)."""
        return (await self.workers.workers(self.settings.served_model_name)).context_limit

    async def encode(self, prompt, chat: bool, template_kwargs: dict | None = None) -> list[list[int]]:
        """Token ids of a validated prompt (chat messages, or any completions prompt form), on the
        tokenizing thread; not checked against the context."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, self._encode, prompt, chat, (),
                                                                template_kwargs)

    def _encode(self, prompt, chat: bool, tools: tuple[dict, ...] = (), template_kwargs: dict | None = None) -> list[list[int]]:
        if chat:  # a template that refuses the conversation (its raise_exception) is the request's fault
            try:
                return [encode_chat(self.tokenizer, prompt, tools, template_kwargs)]
            except TemplateError as err:
                raise InvalidRequestError(f"the chat template refused the messages: {err}", "messages") from None
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt)]
        if isinstance(prompt[0], str):
            return [self.tokenizer.encode(p) for p in prompt]
        if not isinstance(prompt[0], list):  # token ids
            return [list(prompt)]
        return [list(p) for p in prompt]

    def _prompt_ids(self, parsed: ParsedRequest, live: Workers) -> list[list[int]]:
        """On the tokenizing thread: the structured-output constraint checked (a grammar build: not
        on the event loop), the prompts encoded and checked against the context."""
        if parsed.params.structured is not None:
            try:
                check_structured(parsed.params.structured)
            except InvalidRequestError as err:
                prefix = "tools: " if parsed.constraint_field == "tools" else ""
                raise ApiError(400, prefix + str(err), parsed.constraint_field) from None
        try:
            prompts = self._encode(parsed.prompt, parsed.chat, parsed.tools.tools if parsed.tools else (), parsed.template_kwargs)
            if live.vocab_size is not None:  # the bound the workers check against (their config's vocab_size)
                prompts = [check_token_ids(ids, live.vocab_size) for ids in prompts]
        except InvalidRequestError as err:
            raise ApiError(400, str(err), err.field) from None
        limit = live.context_limit
        for ids in prompts:
            if limit is not None and len(ids) + parsed.params.max_tokens > limit:
                raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you "
                               f"requested {len(ids) + parsed.params.max_tokens} tokens ({len(ids)} in the prompt, "
                               f"{parsed.params.max_tokens} for the completion).", "messages" if parsed.chat else "prompt",
                               "context_length_exceeded")
        return prompts

    # ------------------------------------------------------------------ queue
    @contextlib.asynccontextmanager
    async def admission(self, entries: int) -> AsyncIterator[None]:
        """503 without a live worker for the model; 429 when what its shared stream holds, the
        entries this gateway is admitting already and these would pass ``--max-queue-depth``.
        Otherwise these count as admitting until the block ends (added to a stream, or refused):
        a burst is turned away before it is tokenized."""
        model = self.settings.served_model_name
        if not await self.serving():
            raise ApiError(503, f"no worker is serving {model!r} right now", None, "no_worker",
                           "service_unavailable", {"Retry-After": "5"})
        self.admitting += entries  # before the await: requests checked at the same time see each other
        try:
            depth = await self.redis.xlen(self.keys.requests(model)) + self.admitting - entries
            if depth + entries > self.settings.max_queue_depth:
                raise self.queue_full(depth)
            yield
        finally:
            self.admitting -= entries

    def queue_full(self, depth: int) -> ApiError:
        return ApiError(429, f"the queue for {self.settings.served_model_name!r} is full ({depth} waiting); retry shortly",
                        None, "queue_full", "rate_limit_exceeded", {"Retry-After": "1"})

    async def queue_limit(self) -> QueueLimit:
        """``--max-queue-depth`` over everything the model's streams hold: the shared stream and
        the live workers' own (routed) streams, checked in the same step as the add."""
        model = self.settings.served_model_name
        routed = [self.keys.routed(model, w.name) for w in (await self.workers.workers(model)).infos]
        return QueueLimit(self.settings.max_queue_depth, (self.keys.requests(model), *routed))

    def wire_requests(self, parsed: ParsedRequest, prompts: list[list[int]], ids: list[str]) -> list[WireRequest]:
        now = time.time()
        timeout = parsed.timeout or self.settings.request_timeout_s
        reply = ReplyTarget("channel", self.dispatcher.channel)
        adapter = parsed.model if parsed.model != self.settings.served_model_name else None  # checked: serves_adapter
        return [
            WireRequest(id=request_id, model=self.settings.served_model_name, params=parsed.params, reply=reply,
                        prompt_token_ids=prompt, created=now, deadline=now + timeout,
                        priority=parsed.priority, tenant=parsed.user, adapter=adapter)
            for request_id, prompt in zip(ids, prompts)
        ]

    async def routes(self, requests: list[WireRequest]) -> list[str | None]:
        """The stream each request goes to: a worker's own (prefix routing), or None (the model's)."""
        workers = await self.workers.workers(self.settings.served_model_name)
        routes = []
        for r in requests:
            routes.append(await self.router.route_request(workers, list(r.prompt_token_ids), r.tenant, r.adapter))
        for stream in routes:
            self.metrics.routed.labels(self.settings.served_model_name, "prefix" if stream else "shared").inc()
        return routes

    async def cancel(self, request_ids: list[str], reason: str) -> None:
        await self.producer.cancel(self.settings.served_model_name, request_ids, reason)

    @staticmethod
    def new_id(chat: bool) -> str:
        return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex

    async def serving(self) -> bool:
        """Whether a live worker serves this gateway's model."""
        return bool((await self.workers.workers(self.settings.served_model_name)).infos)

    async def serves_adapter(self, name: str) -> bool:
        """Whether a live worker of this gateway's model holds the LoRA adapter ``name``."""
        return name in (await self.workers.workers(self.settings.served_model_name)).adapters

    async def live_models(self) -> list[str]:
        return await self.workers.models()
