"""A worker's events on their way out: one batch per engine step, sent in order by one task, each
batch retried until Redis takes it (``RedisBridge.publish``: the replies, then the acks).

What is sent is what this worker still answers for. Entries let go of (Redis lost them, or another
worker took them over) send nothing more, even what was queued for them before. And when the
liveness key may have expired (no heartbeat got through for three heartbeats: Redis away, a
network partition, a stall), the outbox first asks which entries are still held: another worker
may have taken some over meanwhile, and events from here would contradict that one's. Sends
already on their way when the key expired can still arrive late; readers drop them by
``WireEvent.delivery`` (docs/protocol.md).
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

import structlog

from pagedserve.worker.serve.bridge import Outgoing, RedisBridge
from pagedserve.worker.serve.inflight import InFlightTable

log = structlog.get_logger("pagedserve.worker")
Retrying = Callable[[str, Callable[[], Awaitable]], Awaitable]


class Outbox:
    def __init__(self, bridge: RedisBridge, inflight: InFlightTable, abort: Callable[[str], None], ttl_s: float) -> None:
        """``abort``: stop a request in the engine; ``ttl_s``: the liveness key's time to live."""
        self.bridge = bridge
        self.inflight = inflight
        self.abort = abort
        self.ttl_s = ttl_s
        self._queue: asyncio.Queue[list[Outgoing] | None] = asyncio.Queue()
        self._beaten_at = time.monotonic()  # when the last heartbeat that renewed the liveness key was sent
        self._lost: set[str] = set()  # entries let go of whose events may still be queued

    def put(self, batch: list[Outgoing]) -> None:
        self._queue.put_nowait(batch)

    def close(self) -> None:
        """``run`` returns once what is queued now is sent."""
        self._queue.put_nowait(None)

    def beaten(self, sent: float) -> None:
        """A heartbeat sent at ``sent`` (monotonic) renewed the liveness key."""
        self._beaten_at = max(self._beaten_at, sent)

    def let_go(self, lost_entries: set[str]) -> None:
        """Stop the requests of entries no longer held, and send nothing more queued for them."""
        self._lost |= lost_entries
        for request_id in self.inflight.let_go(lost_entries):
            self.abort(request_id)

    async def run(self, retrying: Retrying) -> None:
        """Send batch after batch until ``close``; a reply target Redis refuses stops its requests."""
        while (batch := await self._queue.get()) is not None:
            for target, err in await retrying("publish", lambda: self._send(batch)):
                ids = sorted({item.event.id for item in batch if item.target == target})
                log.warning("reply target refused; its requests are dropped", target=target.name, error=str(err),
                            requests=ids)
                for request_id in ids:  # nobody can hear them: stop computing
                    if request_id in self.inflight:
                        self.abort(request_id)

    async def _send(self, batch: list[Outgoing]) -> list:
        if not self._kept(batch):  # nothing this worker still answers for: no need to reach Redis at all
            return []
        if time.monotonic() - self._beaten_at > self.ttl_s:
            sent = time.monotonic()
            entries = {*self.inflight.beating(), *(i.entry_id for i in batch if i.entry_id)}
            held = await self.bridge.confirm_held(sorted(entries), self.ttl_s)
            self.beaten(sent)
            if entries - held:
                log.warning("requests taken over while this worker could not beat: their events are dropped",
                            entries=sorted(entries - held))
            self.let_go(entries - held)
        failed = await self.bridge.publish(self._kept(batch))
        if self._queue.empty():  # nothing queued refers to an entry let go of any more
            self._lost.clear()
        return failed

    def _kept(self, batch: list[Outgoing]) -> list[Outgoing]:
        """What of ``batch`` is still to be sent: not for an entry let go of."""
        return [i for i in batch if i.entry_id not in self._lost]
