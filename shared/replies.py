"""One pub/sub reader per process fans reply events out to per-request mailboxes.

Subscribe before enqueue: ``open(request_id)`` must be called (and the reader subscribed) before
the request is pushed, or early events are missed. A mailbox checks sequence numbers: duplicates
(a worker resending after a reconnect) are dropped; a gap ends the request with an error event,
never a silently short answer. Mailboxes are bounded; a consumer that falls that far behind gets
an error instead of unbounded memory.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import AsyncIterator

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ConnectionError as RedisConnectionError

from shared.errors import InvalidRequestError
from shared.protocol import WireEvent, decode_events
from shared.redis_io import listen_forever

log = structlog.get_logger("pagedserve.dispatch")
MAILBOX_LIMIT = 10_000


class Mailbox:
    def __init__(self, request_id: str, limit: int = MAILBOX_LIMIT) -> None:
        self.request_id = request_id
        self._events: deque[WireEvent] = deque()
        self._ready = asyncio.Event()
        self._limit = limit
        self._next_seq = 0
        self.done = False

    def put(self, event: WireEvent) -> None:
        if self.done:
            return
        if len(self._events) >= self._limit:
            self._events.clear()
            self._events.append(_failure(self.request_id, "the client fell too far behind; events were dropped"))
        else:
            self._events.append(event)
        self._ready.set()

    async def events(self) -> AsyncIterator[WireEvent]:
        """Events in order, ending with exactly one terminal event (``done``)."""
        while not self.done:
            if not self._events:
                self._ready.clear()
                await self._ready.wait()
                continue
            event = self._events.popleft()
            if event.seq == -1:  # an out-of-band terminal error
                self.done = True
                yield event
                return
            if event.seq < self._next_seq:
                continue  # a duplicate from a resend
            if event.seq > self._next_seq:
                self.done = True
                yield _failure(self.request_id, f"lost events {self._next_seq}..{event.seq - 1} (sequence gap)")
                return
            self._next_seq += 1
            self.done = event.done
            yield event


def _failure(request_id: str, message: str) -> WireEvent:
    return WireEvent(request_id, -1, [], True, "error", message)


class ReplyDispatcher:
    def __init__(self, client: aioredis.Redis, channel: str) -> None:
        self.client = client
        self.channel = channel
        self._boxes: dict[str, Mailbox] = {}
        self._task: asyncio.Task | None = None
        self._subscribed = asyncio.Event()

    async def start(self, wait: bool = True) -> None:
        """Start reading; with ``wait``, return once subscribed (a service starts without waiting,
        so it can answer "Redis unavailable" instead of not answering at all)."""
        if self._task is None:
            self._task = asyncio.create_task(self._read())
        if wait:
            await self._subscribed.wait()

    async def ready(self, timeout: float) -> None:
        """Return once the channel is subscribed; ``RedisConnectionError`` if it is not within ``timeout``:
        a request sent before the subscription holds could lose its first events."""
        try:
            await asyncio.wait_for(self._subscribed.wait(), timeout)
        except asyncio.TimeoutError:
            raise RedisConnectionError(f"not subscribed to {self.channel} (Redis unreachable?)") from None

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def open(self, request_id: str) -> Mailbox:
        box = self._boxes[request_id] = Mailbox(request_id)
        return box

    def close(self, request_id: str) -> None:
        self._boxes.pop(request_id, None)

    async def _read(self) -> None:
        await listen_forever(self.client, self.channel, self._deliver, self._subscribed.set, self._subscribed.clear)

    def _deliver(self, data: bytes) -> None:
        try:
            events = decode_events(data)
        except (InvalidRequestError, KeyError, TypeError) as err:
            log.warning("undecodable reply batch", error=str(err))
            return
        for event in events:
            box = self._boxes.get(event.id)
            if box is not None:
                box.put(event)
