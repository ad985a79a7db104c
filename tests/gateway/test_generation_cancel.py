"""A request handler cancelled, and cancelled again while its cancel goes out to the workers (a
client gone, then a server stopping), closes every mailbox it opened: none is left for the
dispatcher to watch, find its queue entry gone and warn about forever (the soak's gateway leaked
nine such mailboxes in ten minutes)."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
from aiohttp import web

from pagedserve.gateway.bodies.parse import parse
from pagedserve.gateway.service.generation import STATE, generation
from tests.gateway_stack import MODEL_NAME
from tests.service_helpers import poll


class HandlerRequest(dict):
    """What ``generation`` reads of an aiohttp request: its app, and a place for the tally."""

    def __init__(self, app: web.Application) -> None:
        super().__init__()
        self.app = app


def test_a_handler_cancelled_twice_leaves_no_mailbox_open(stack):
    app = stack.runners[0].app
    state = app[STATE]
    body = {"model": MODEL_NAME, "prompt": ["go on", "and on"], "max_tokens": 500, "ignore_eos": True}
    parsed = parse(body, False, state.limits, state.sampling_defaults)
    got_events = asyncio.Event()

    async def handler():
        async with generation(HandlerRequest(app), parsed) as sent:
            async for _ in sent.events:
                got_events.set()

    sending = asyncio.Event()

    async def cancel_slowly(request_ids, reason):  # the workers' cancel takes a while to go out
        sending.set()
        await asyncio.sleep(0.2)
        await type(state).cancel(state, request_ids, reason)

    async def scenario() -> tuple[int, int]:
        task = asyncio.create_task(handler())
        await asyncio.wait_for(got_events.wait(), 30)
        during = state.dispatcher.open_count
        task.cancel()  # the client went away
        await asyncio.wait_for(sending.wait(), 10)  # the handler is on its way out, sending the cancel
        task.cancel()  # and is cancelled again
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return during, state.dispatcher.open_count

    state.cancel = cancel_slowly
    try:
        during, after = stack.run(scenario())
    finally:
        del state.cancel
    assert (during, after) == (2, 0)
    metrics = httpx.get(stack.url + "/metrics").text
    assert "pagedserve:gateway_open_requests 0.0" in metrics
    poll(lambda: not stack.worker.inflight, 10, "the worker ended both (the cancel went out)")
