"""One request's events as its reader sees them: in order, resends dropped, a gap an error, and a
request whose worker died mid-stream (or whose queue entry vanished) sent again, not failed.

Sequence numbers: duplicates (a worker resending after a reconnect) are dropped; a gap (events
lost while pub/sub was disconnected) is never a silently short answer. A mailbox is bounded; a
reader that falls that far behind gets an error instead of unbounded memory.

Holders: every event says the delivery count of the entry its sender holds. The mailbox takes the
highest it has heard: events from a lower one (a worker cut off from Redis whose entry another
took over, sending late) are dropped, and a higher one arriving after events of a lower one went
to the reader (the new holder ran from the prompt, not knowing them) is handled as a resumable
failure, so the reader never sees two runs mixed.

Going on after a failure: a gap, or a terminal error marked ``resumable`` (a worker took the
request over after its holder died, or the dispatcher found its stream entry gone), does not reach
the reader. The mailbox sends the request again under a new attempt id (``{id}~{n}``: events of
the old attempt, from a worker that has not noticed yet, are then ignored, and the old attempt is
cancelled): from the prompt when nothing came yet, otherwise with ``resume`` (the output tokens
delivered so far and the next ``seq``) when the request can go on (n = 1, no beam search, no
best_of). The reader sees a pause, then the rest of the stream; where it cannot go on, the error.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import replace
from typing import AsyncIterator, Awaitable, Callable

import structlog

from pagedserve.runtime.redis_io import REDIS_DOWN
from pagedserve.shared.protocol import MAX_ID_LEN, Resume, WireEvent, WireRequest, can_resume

log = structlog.get_logger("pagedserve.mailbox")
MAILBOX_LIMIT = 10_000
MAX_RESENDS = 3

# Pushes a new attempt of a request (cancelling the attempt with the given id); its stream entry id.
Resend = Callable[[WireRequest, str], Awaitable[str]]


def attempt_id(request_id: str, attempt: int) -> str:
    return f"{request_id[: MAX_ID_LEN - 8]}~{attempt}"


class Mailbox:
    def __init__(self, request_id: str, limit: int = MAILBOX_LIMIT, request: WireRequest | None = None,
                 resend: Resend | None = None) -> None:
        self.request_id = request_id
        self.request = request  # the current attempt, kept to send again; None: this mailbox only reads
        self.entry_id: str | None = None  # the request's current stream entry, once pushed
        self.stream: str | None = None  # the stream it was pushed onto, when not the model's (routed)
        self.heard_at = time.monotonic()  # when an event (or the request) last went through
        self.missing_checks = 0  # consecutive checks that found the entry gone (the dispatcher's)
        self.done = False
        self._events: deque[WireEvent] = deque()
        self._ready = asyncio.Event()
        self._limit = limit
        self._next_seq = 0
        self._resend = resend
        self._resends = 0
        self._holder = 0  # the highest delivery count heard for the current attempt (WireEvent.delivery)
        self._keep_tokens = request is not None and can_resume(request.params)
        self._tokens: list[int] = []  # output 0's tokens delivered: where a resumed run goes on
        self._failed: Exception | None = None  # raised by ``events`` once what came before it is read (``fail``)

    @property
    def wire_id(self) -> str:
        """The id the current attempt has on the wire (events, cancels)."""
        return self.request.id if self.request is not None else self.request_id

    def put(self, event: WireEvent) -> None:
        if self.done or event.id != self.wire_id:
            return  # over, or from an attempt given up on
        self.heard_at = time.monotonic()
        if len(self._events) >= self._limit:
            self._events.clear()
            self._events.append(failure(self.wire_id, "the client fell too far behind; events were dropped"))
        else:
            self._events.append(event)
        self._ready.set()

    def fail(self, error: Exception) -> None:
        """End the request on this side: ``events`` raises ``error`` after the events already here
        (Redis gone past the outage grace: nothing more can come)."""
        if not self.done and self._failed is None:
            self._failed = error
            self._ready.set()

    @property
    def failed(self) -> bool:
        """Whether ``fail`` ended it."""
        return self._failed is not None

    async def events(self) -> AsyncIterator[WireEvent]:
        """Events in order, ending with exactly one terminal event (``done``), or raising what
        ``fail`` was given."""
        while not self.done:
            if not self._events:
                if self._failed is not None:
                    self.done = True
                    raise self._failed
                self._ready.clear()
                await self._ready.wait()
                continue
            event = self._events.popleft()
            if event.id != self.wire_id:
                continue  # queued before its attempt was given up on
            if 0 < event.delivery < self._holder:  # (0: not said, as this side's own failures)
                continue  # from a worker whose entry another has taken over since (it sent late)
            if event.delivery > self._holder:
                taken_over = self._holder > 0 and self._next_seq > 0 and event.seq != -1
                self._holder = event.delivery
                if taken_over:  # the new holder ran it again from the prompt, not from what was read
                    event = failure(self.wire_id, "another worker took the request over after events went out", True)
            if event.seq > self._next_seq:
                event = failure(self.wire_id, f"lost events {self._next_seq}..{event.seq - 1} (sequence gap)", True)
            if event.seq == -1:  # an out-of-band terminal error
                if event.resumable and await self._send_again(event.error):
                    continue
                self.done = True
                yield replace(event, id=self.request_id)
                return
            if event.seq < self._next_seq:
                continue  # a duplicate from a resend
            self._next_seq += 1
            self.done = event.done
            if self._keep_tokens:
                self._tokens.extend(t for o in event.outputs if o.index == 0 for t in o.token_ids)
            yield event if event.id == self.request_id else replace(event, id=self.request_id)

    async def _send_again(self, why: str | None) -> bool:
        """Push a new attempt (with ``resume`` once events came); False when it cannot go on."""
        old = self.request
        if old is None or self._resend is None or self._resends >= MAX_RESENDS:
            return False
        if self._next_seq and not self._keep_tokens:
            return False
        resume = Resume(list(self._tokens), self._next_seq) if self._next_seq else None
        self.request = replace(old, id=attempt_id(self.request_id, self._resends + 1), resume=resume)
        self._holder = 0  # the new attempt's entry counts its own deliveries
        self._resends += 1
        try:
            self.entry_id = await self._resend(self.request, old.id)
            self.stream = None  # a new attempt goes onto the model's stream
        except REDIS_DOWN as err:
            log.warning("could not send the request again", request_id=self.request_id, error=str(err))
            return False
        self.missing_checks = 0
        self.heard_at = time.monotonic()
        log.info("request sent again", request_id=self.request_id, why=why, tokens_delivered=len(self._tokens),
                 next_seq=self._next_seq)
        return True


def failure(request_id: str, message: str, resumable: bool = False) -> WireEvent:
    """A terminal error event made on the reading side."""
    return WireEvent(request_id, -1, [], True, "error", message, resumable=resumable)
