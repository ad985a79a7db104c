"""Which worker holds which prefix: block hash -> workers, kept from the model's KV stream.

Workers publish what their prefix caches gain and lose (``shared/kv_wire.py``); ``KvIndex`` applies
those events in stream order and ``follow`` keeps reading the stream (from its start when the
gateway starts: the stream keeps the last few thousand events, and every worker sends all it holds
as a reset every few seconds, so a gateway that starts late, or a stream Redis lost, catches up).
A worker that stops beating is dropped by the router's liveness view (``forget``).
"""

from __future__ import annotations

import asyncio
from typing import Sequence

import redis.asyncio as aioredis
import structlog

from pagedserve.runtime.redis_io import REDIS_DOWN
from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.kv_wire import KvEvent

log = structlog.get_logger("pagedserve.gateway")


class KvIndex:
    def __init__(self) -> None:
        self.blocks: dict[str, set[int]] = {}  # worker -> the hashes its prefix cache holds

    def apply(self, event: KvEvent) -> None:
        held = self.blocks.setdefault(event.worker, set())
        if event.reset:
            held.clear()
        held.difference_update(event.dropped)
        held.update(event.published)

    def forget(self, worker: str) -> None:
        self.blocks.pop(worker, None)

    def matched(self, worker: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its hash chain) ``worker`` holds."""
        held = self.blocks.get(worker)
        if not held:
            return 0
        count = 0
        for block_hash in hashes:
            if block_hash not in held:
                break
            count += 1
        return count

    async def follow(self, redis: aioredis.Redis, stream: str, stop: asyncio.Event, block_ms: int = 250) -> None:
        """Apply the stream's events as they come, until ``stop`` is set; after a lost connection,
        read it again from the start (Redis may have restarted empty: new ids could be lower)."""
        last, delay = "0", 0.2
        while not stop.is_set():
            try:
                reply = await redis.xread({stream: last}, count=1000, block=block_ms)
                delay = 0.2
            except REDIS_DOWN as err:
                log.warning("KV stream unavailable; reading it again once Redis is back", error=str(err), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay, last = min(delay * 2, 5.0), "0"
                self.blocks.clear()
                continue
            for _, items in reply or []:
                for entry_id, fields in items:
                    last = entry_id
                    try:
                        self.apply(KvEvent.decode(fields.get(b"data", b"")))
                    except InvalidRequestError as err:
                        log.warning("bad KV event skipped", entry_id=entry_id, error=str(err))
