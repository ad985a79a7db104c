"""Which worker holds which prefix, and where: block hashes per worker on its device and on the
tiers below it (host memory, disk), kept from the model's KV stream.

Workers publish what their prefix caches gain and lose (``shared/kv_wire.py``); ``KvIndex`` applies
those events in stream order and ``follow`` keeps reading the stream (from its start when the
gateway starts: the stream keeps the last few thousand events, and every worker sends all it holds
as a reset every few seconds, so a gateway that starts late, or a stream Redis lost, catches up).
A worker that stops beating is dropped by the router's liveness view (``forget``).
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple, Sequence

import redis.asyncio as aioredis
import structlog

from pagedserve.runtime.redis_io import REDIS_DOWN
from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.kv_wire import KvEvent

log = structlog.get_logger("pagedserve.gateway")


class Match(NamedTuple):
    """The leading blocks of a prompt one worker holds: on its device, and below it."""
    device: int
    below: int

    @property
    def blocks(self) -> int:
        return self.device + self.below


class KvIndex:
    def __init__(self) -> None:
        self.blocks: dict[str, set[int]] = {}  # worker -> the hashes on its device
        self.lower: dict[str, set[int]] = {}  # worker -> the hashes only its tiers below the device hold

    def apply(self, event: KvEvent) -> None:
        held = self.blocks.setdefault(event.worker, set())
        below = self.lower.setdefault(event.worker, set())
        if event.reset:
            held.clear()
            below.clear()
        for gone in (event.dropped, event.lowered):
            held.difference_update(gone)
        below.difference_update(event.dropped)
        below.difference_update(event.published)
        held.update(event.published)
        below.update(event.lowered)

    def forget(self, worker: str) -> None:
        self.blocks.pop(worker, None)
        self.lower.pop(worker, None)

    def matched(self, worker: str, hashes: Sequence[int]) -> Match:
        """How many leading blocks of a prompt (its hash chain) ``worker`` holds, on which tier."""
        held, below = self.blocks.get(worker, ()), self.lower.get(worker, ())
        device = lower = 0
        for block_hash in hashes:
            if block_hash in held:
                device += 1
            elif block_hash in below:
                lower += 1
            else:
                break
        return Match(device, lower)

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
                self.lower.clear()
                continue
            for _, items in reply or []:
                for entry_id, fields in items:
                    last = entry_id
                    try:
                        self.apply(KvEvent.decode(fields.get(b"data", b"")))
                    except InvalidRequestError as err:
                        log.warning("bad KV event skipped", entry_id=entry_id, error=str(err))
