"""What a worker does while Redis is unreachable (``runtime/outage.py``): every call that fails or
gets through tells it. Past the outage grace, or once the worker is stopping, it lets go of the
requests it holds: they are aborted in the engine (their blocks back to the pool) and nothing queued
for them is sent (``Outbox.let_go``). Past the grace, their gateways have ended them with an error:
once Redis is back the entries this worker still holds are acknowledged, so nobody runs them again.
While stopping, they stay pending, for another worker to take over.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import structlog

from pagedserve.runtime.outage import Outage
from pagedserve.worker.serve.bridge import RedisBridge
from pagedserve.worker.serve.inflight import InFlightTable
from pagedserve.worker.serve.outbox import Outbox

log = structlog.get_logger("pagedserve.worker")
Retrying = Callable[[str, Callable[[], Awaitable]], Awaitable]


class OutageWatch:
    def __init__(self, grace_s: float, inflight: InFlightTable, outbox: Outbox, bridge: RedisBridge,
                 stopping: asyncio.Event, liveness_s: float) -> None:
        self.outage = Outage(grace_s)
        self.inflight, self.outbox, self.bridge, self.stopping, self.liveness_s = inflight, outbox, bridge, stopping, liveness_s
        self.cut = False  # requests let go of while stopping (the exit code says so)
        self._abandoned: set[str] = set()  # entries let go of past the grace: acknowledged once Redis is back
        self._jobs: set[asyncio.Task] = set()

    @property
    def down(self) -> bool:
        """Whether the last call found Redis unreachable."""
        return self.outage.down

    def failed(self) -> None:
        """A call found Redis unreachable: past the grace, or while stopping, let go of what is held."""
        self.outage.failed()
        if self.outage.past_grace():
            self.let_go_held(f"Redis unreachable for {self.outage.down_s:.0f} s (--outage-grace {self.outage.grace_s:g})")
        elif self.stopping.is_set():
            self.let_go_held("stopping while Redis is unreachable")

    def let_go_held(self, why: str) -> None:
        entries = set(self.inflight.beating())
        if not entries:
            return
        log.error("letting go of the requests held: their events cannot be delivered", why=why, requests=len(entries))
        self.outbox.let_go(entries)
        if self.stopping.is_set():
            self.cut = True
        else:
            self._abandoned |= entries

    def reached(self, retrying: Retrying) -> None:
        """A call got through: after an outage, acknowledge (``retrying`` it) what was let go of."""
        if not self.outage.down:
            return
        log.info("redis reachable again", down_s=round(self.outage.down_s, 1))
        self.outage.reached()
        if self._abandoned:
            entries, self._abandoned = sorted(self._abandoned), set()
            job = asyncio.create_task(retrying("acknowledge the entries let go of", lambda: self._drop(entries)))
            self._jobs.add(job)
            job.add_done_callback(self._jobs.discard)

    async def _drop(self, entries: list[str]) -> None:
        """Acknowledge the entries still held (another worker may have taken some over meanwhile:
        those are its own now)."""
        held = await self.bridge.confirm_held(entries, self.liveness_s)
        await self.bridge.ack(sorted(held))
        log.info("entries let go of in the outage acknowledged", held=len(held), taken_over=len(entries) - len(held))
