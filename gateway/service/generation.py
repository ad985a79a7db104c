"""One generation request's life, whatever API asked for it: parsed, tokenized, admitted, sent to the
workers, its events merged as they come, and every wire request not finished cancelled when the
handler ends (client gone, timeout, shutdown: aiohttp handler cancellation). Every generating route
renders what it yields: completions and chat (``gateway/routes/openai.py``), the Responses API
(``gateway/routes/responses.py``), Anthropic's Messages (``gateway/routes/anthropic.py``) and embeddings
(``embeddings_api.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from aiohttp import web

from pagedserve.gateway.bodies.parse import ApiError, ParsedRequest, prompt_count
from pagedserve.gateway.http.api_error import note_refusal
from pagedserve.gateway.service.instance import GatewayService
from pagedserve.runtime.mailbox import Mailbox
from pagedserve.runtime.outage import RedisGone
from pagedserve.runtime.producer import QueueFull
from pagedserve.runtime.queue_wait import MISSING, get_within
from pagedserve.shared.protocol import WireEvent

STATE = web.AppKey("state", GatewayService)
TALLY: web.RequestKey["Tally"] = web.RequestKey("tally", "Tally")  # a generation request's Tally, for the access log
CANCEL_WAIT_S = 2.0  # the longest a finished handler waits for its cancel to go out


async def read_json(request: web.Request):
    """The request body as JSON, or a 400 saying why it is not."""
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None


@dataclass
class Generation:
    """A sent request: its id, its prompts' token ids, its events (prompt index, event) as they
    arrive, and its tally."""
    id: str
    prompts: list[list[int]]
    events: AsyncIterator[tuple[int, WireEvent]]
    tally: "Tally"


@contextlib.asynccontextmanager
async def generation(request: web.Request, parsed: ParsedRequest) -> AsyncIterator[Generation]:
    """Send ``parsed`` (one wire request per prompt) and yield its ``Generation``; on the way out,
    cancel whatever is not finished."""
    state = request.app[STATE]
    started = time.monotonic()
    state.note_ignored(parsed.ignored)
    if parsed.model != state.settings.served_model_name and not await state.serves_adapter(parsed.model):
        raise ApiError(404, f"the model {parsed.model!r} does not exist", "model", "model_not_found")
    base, prompts, boxes = await _admitted(state, parsed)
    tally = request[TALLY] = Tally(started, sum(len(p) for p in prompts))
    state.metrics.prompt_tokens.labels(parsed.model).inc(tally.prompt_tokens)
    try:
        deadline = started + (parsed.timeout or state.settings.request_timeout_s) + 5
        yield Generation(base, prompts, _merged(request, boxes, deadline), tally)
    finally:
        if tally.longest_gap:  # two token events of one request, or more
            state.metrics.longest_gap.labels(parsed.model).observe(tally.longest_gap)
        await _close(state, boxes, cancel=True)


async def _admitted(state: GatewayService, parsed: ParsedRequest) -> tuple[str, list[list[int]], list[Mailbox]]:
    """Admit, tokenize and send ``parsed``: its id, prompts and open mailboxes, or an error with
    none left open. From the admission check to the add, its entries count as queued
    (``state.admission``): a burst is turned away before it is tokenized, and the add itself checks
    the limit again, in one step with what the streams hold (``QueueLimit``)."""
    entries = 1 if parsed.chat else prompt_count(parsed.prompt)
    async with state.admission(entries):
        prompts = await state.prompt_ids(parsed)
        base = state.new_id(parsed.chat)
        ids = [base if len(prompts) == 1 else f"{base}-{i}" for i in range(len(prompts))]
        boxes = [state.dispatcher.open(r) for r in state.wire_requests(parsed, prompts, ids)]
        try:  # subscribed first
            await state.dispatcher.send(boxes, await state.routes([b.request for b in boxes]), limit=await state.queue_limit())
        except QueueFull as full:  # nothing was added
            await _close(state, boxes, cancel=False)
            raise state.queue_full(full.depth) from None
        except BaseException:
            await _close(state, boxes, cancel=True)
            raise
    return base, prompts, boxes


async def _close(state: GatewayService, boxes: list[Mailbox], cancel: bool) -> None:
    """Close the mailboxes first, before any await (a handler cancelled again while the cancel goes
    out, a client gone and then the server stopping, must not leave them open for good); then, with
    ``cancel``, ask the workers to stop what is not finished: at most ``CANCEL_WAIT_S`` (a Redis cut
    off would hold the handler, and a stopping gateway, for a command timeout; its workers abort
    what they hold past the outage grace anyway)."""
    unfinished = [b.wire_id for b in boxes if not b.done and not b.failed]
    for box in boxes:
        state.dispatcher.close(box)
    if cancel and unfinished:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(state.cancel(unfinished, "client gone")), CANCEL_WAIT_S)


async def _merged(request: web.Request, boxes: list[Mailbox], deadline: float) -> AsyncIterator[tuple[int, WireEvent]]:
    """(prompt index, event) from every mailbox as they arrive, until all are done; a 504 past the
    deadline, a 503 once Redis is gone past the outage grace (``RedisGone``)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, box: Mailbox) -> None:
        try:
            async for event in box.events():
                queue.put_nowait((index, event))
        except RedisGone as gone:
            queue.put_nowait((index, gone))
            return
        queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, b)) for i, b in enumerate(boxes)]
    try:
        open_count = len(boxes)
        while open_count:
            got = await get_within(queue, deadline - time.monotonic())  # a cancel (the client gone) propagates
            if got is MISSING:
                raise _refused(request, ApiError(504, "the request timed out before a worker finished it", None, "timeout",
                                                 "timeout"))
            index, event = got
            if isinstance(event, RedisGone):
                raise _refused(request, ApiError(503, str(event), None, "redis_unavailable", "service_unavailable",
                                                 {"Retry-After": "5"})) from None
            if event is None:
                open_count -= 1
            else:
                yield index, event
    finally:
        for task in tasks:
            task.cancel()


def _refused(request: web.Request, err: ApiError) -> ApiError:
    note_refusal(request, err)
    return err


@dataclass
class Tally:
    """What one HTTP request has produced so far: for the latency metrics and the access log."""

    started: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the workers' prefix caches served (their terminal events say)
    last: dict = field(default_factory=dict)  # wire id -> when its last tokens came
    longest_gap: float = 0.0  # the longest wait between two token events of one wire request


def account(state: GatewayService, parsed: ParsedRequest, event: WireEvent, tally: Tally, now: float) -> None:
    tokens = sum(len(o.token_ids) for o in event.outputs)
    last = tally.last
    if event.queue_s is not None:
        state.metrics.queue_time.labels(parsed.model).observe(event.queue_s)
    if tokens:
        model = parsed.model
        tally.completion_tokens += tokens
        state.metrics.generation_tokens.labels(model).inc(tokens)
        if event.id in last:
            state.metrics.next_token(model, now - last[event.id])
            tally.longest_gap = max(tally.longest_gap, now - last[event.id])
        elif not last:
            state.metrics.first_token(model, now - tally.started)
        last[event.id] = now
    if event.done:
        state.metrics.requests.labels(parsed.model, event.finish_reason or "unknown").inc()
        tally.cached_tokens += int((event.usage or {}).get("cached_tokens", 0))


