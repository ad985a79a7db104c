"""The worker's KV events: what its prefix cache published, lowered to a tier below the device and
dropped (block hashes, taken on the engine thread after each step), merged on the I/O thread and sent on the model's KV stream at
most every ``interval_s``. A reset with every hash the cache holds goes out at start, every
``resync_s`` and after Redis was lost; an empty reset when the worker stops. Gateways route on
them (``gateway/routing/kv_index.py``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

import structlog

from pagedserve.runtime.redis_io import REDIS_DOWN
from pagedserve.shared.kv_wire import KvEvent
from pagedserve.worker.core.kv_cache.kv_events import KvChanges, KvEvents
from pagedserve.worker.serve.bridge import RedisBridge

log = structlog.get_logger("pagedserve.worker")
KV_STREAM_LEN = 10_000  # KV events kept (about): a gateway starting later also gets resyncs


class KvPublisher:
    def __init__(self, bridge: RedisBridge, worker: str, interval_s: float, resync_s: float,
                 resync: Callable[[], None], redis_back: Callable[[], Awaitable[None]]) -> None:
        self.bridge, self.worker = bridge, worker
        self.interval_s, self.resync_s = interval_s, resync_s
        self.resync = resync  # asks the engine thread for every hash it holds
        self.redis_back = redis_back  # returns once Redis answers again
        self.pending = KvEvents()  # merged until the next flush (I/O thread only)
        self.loop: asyncio.AbstractEventLoop | None = None

    def from_engine_thread(self, changes: KvChanges) -> None:
        self.loop.call_soon_threadsafe(self.pending.add, changes)

    async def run(self, stop: asyncio.Event) -> None:
        resync_at = time.monotonic() + self.resync_s
        while not stop.is_set():
            await asyncio.sleep(self.interval_s)
            if time.monotonic() >= resync_at:
                resync_at = time.monotonic() + self.resync_s
                self.resync()
            if not self.pending:
                continue
            changes = self.pending.take()
            event = KvEvent(self.worker, changes.published, changes.dropped, changes.reset, changes.lowered)
            try:
                await self.bridge.publish_kv(event.encode(), KV_STREAM_LEN)
            except REDIS_DOWN as err:  # the stream may be gone with Redis: send everything once it is back
                log.warning("redis unavailable", during="kv events", error=str(err))
                await self.redis_back()
                self.resync()

    async def goodbye(self) -> None:
        """The worker is leaving: its cache is empty for every reader."""
        await self.bridge.publish_kv(KvEvent(self.worker, reset=True).encode(), KV_STREAM_LEN)
