"""What one gateway instance holds: Redis, its reply dispatcher, the model's tokenizer, metrics.

Prompts are tokenized here, once: the gateway needs the token count anyway (a prompt longer than
the model's context is a 400 before it queues), and workers receive ``prompt_token_ids``.
"""

from __future__ import annotations

import time
import uuid

import redis.asyncio as aioredis

from gateway.metrics import GatewayMetrics
from gateway.schemas import ApiError, Limits, ParsedRequest
from shared.dispatch import ReplyDispatcher
from shared.keys import Keys
from shared.model_info import max_model_len, resolve_model_dir
from shared.protocol import ReplyTarget, WireCancel, WireRequest
from shared.settings import GatewaySettings


class GatewayState:
    def __init__(self, settings: GatewaySettings) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        path = resolve_model_dir(settings.model)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.max_model_len = max_model_len(AutoConfig.from_pretrained(path))
        self.limits = Limits(max_n=settings.max_n, max_tokens=settings.max_tokens,
                             default_chat_max_tokens=settings.default_chat_max_tokens)
        # Blocking pool: a burst of requests waits for a connection instead of failing.
        self.redis = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(
            settings.redis_url, max_connections=64, timeout=30))
        self.dispatcher = ReplyDispatcher(self.redis, self.keys.replies(settings.gateway_id))
        self.metrics = GatewayMetrics(self.redis, self.keys, settings.served_model_name)

    async def start(self) -> None:
        await self.dispatcher.start()

    async def close(self) -> None:
        await self.dispatcher.stop()
        await self.redis.aclose()

    # ------------------------------------------------------------------ prompts
    def prompt_ids(self, parsed: ParsedRequest) -> list[list[int]]:
        """Token ids of every prompt, checked against the context length."""
        if parsed.chat:
            text = self.tokenizer.apply_chat_template(parsed.prompt, tokenize=False, add_generation_prompt=True)
            prompts = [self.tokenizer.encode(text, add_special_tokens=False)]
        elif isinstance(parsed.prompt, str):
            prompts = [self.tokenizer.encode(parsed.prompt)]
        elif isinstance(parsed.prompt[0], str):
            prompts = [self.tokenizer.encode(p) for p in parsed.prompt]
        elif isinstance(parsed.prompt[0], int):
            prompts = [list(parsed.prompt)]
        else:
            prompts = [list(p) for p in parsed.prompt]
        vocab = len(self.tokenizer)
        for ids in prompts:
            if any(not 0 <= t < vocab for t in ids):
                raise ApiError(400, f"token ids must be in [0, {vocab})", "prompt")
            if len(ids) + parsed.params.max_tokens > self.max_model_len:
                raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                               f"requested {len(ids) + parsed.params.max_tokens} tokens ({len(ids)} in the prompt, "
                               f"{parsed.params.max_tokens} for the completion).", "messages" if parsed.chat else "prompt",
                               "context_length_exceeded")
        return prompts

    # ------------------------------------------------------------------ queue
    async def check_capacity(self) -> None:
        """503 without a live worker for the model; 429 when its stream is deeper than the limit."""
        model = self.settings.served_model_name
        alive = [k async for k in self.redis.scan_iter(match=self.keys.alive_pattern(model), count=100)]
        if not alive:
            raise ApiError(503, f"no worker is serving {model!r} right now", None, "no_worker",
                           "service_unavailable", {"Retry-After": "5"})
        depth = await self.redis.xlen(self.keys.requests(model))
        if depth > self.settings.max_queue_depth:
            raise ApiError(429, f"the queue for {model!r} is full ({depth} waiting); retry shortly", None,
                           "queue_full", "rate_limit_exceeded", {"Retry-After": "1"})

    async def enqueue(self, parsed: ParsedRequest, prompts: list[list[int]], ids: list[str]) -> None:
        now = time.time()
        timeout = parsed.timeout or self.settings.request_timeout_s
        reply = ReplyTarget("channel", self.dispatcher.channel)
        pipe = self.redis.pipeline(transaction=False)
        for request_id, prompt in zip(ids, prompts):
            request = WireRequest(id=request_id, model=self.settings.served_model_name, params=parsed.params, reply=reply,
                                  prompt_token_ids=prompt, created=now, deadline=now + timeout,
                                  priority=parsed.priority, tenant=parsed.user)
            pipe.xadd(self.keys.requests(self.settings.served_model_name), {"data": request.encode()})
        await pipe.execute()

    async def cancel(self, request_ids: list[str], reason: str) -> None:
        if request_ids:
            pipe = self.redis.pipeline(transaction=False)
            for request_id in request_ids:
                pipe.publish(self.keys.cancel(self.settings.served_model_name), WireCancel(request_id, reason).encode())
            await pipe.execute()

    @staticmethod
    def new_id(chat: bool) -> str:
        return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex

    async def live_models(self) -> list[str]:
        names = set()
        async for key in self.redis.scan_iter(match=self.keys.alive_pattern(), count=100):
            names.add(key.decode().split(":")[-2])
        return sorted(names)
