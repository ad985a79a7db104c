"""One generated answer as the Responses and Messages routes read it: its text as its events come
(``Collected``) and the deltas of a one-prompt generation counted into it (``deltas``: a worker's
error ends it as a 502). What the text holds: ``gateway/answers/text.py``."""

from __future__ import annotations

import time
from typing import AsyncIterator

from pagedserve.gateway.bodies.parse import ParsedRequest
from pagedserve.gateway.http.api_error import ApiError
from pagedserve.gateway.service.generation import Generation, account
from pagedserve.shared.protocol import OutputDelta


class Collected:
    """One choice's text so far, how it ended, and its tokens."""

    def __init__(self) -> None:
        self.text, self.finish, self.output_tokens = "", None, 0
        self.stop_string: str | None = None  # the stop string that ended it, when one did

    def add(self, delta: OutputDelta) -> None:
        self.text += delta.text
        self.output_tokens += len(delta.token_ids)
        self.finish = delta.finish_reason or self.finish
        if isinstance(delta.stop_reason, str):
            self.stop_string = delta.stop_reason


async def deltas(state, parsed: ParsedRequest, sent: Generation, got: Collected) -> AsyncIterator[OutputDelta]:
    async for _, wire in sent.events:
        account(state, parsed, wire, sent.tally, time.monotonic())
        if wire.done and wire.finish_reason == "error":
            raise ApiError(502, wire.error or "the worker failed", None, "worker_error", "server_error")
        for delta in wire.outputs:
            got.add(delta)
            yield delta
