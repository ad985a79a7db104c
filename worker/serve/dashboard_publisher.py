"""The worker's KV dashboard feed: while a gateway says a dashboard is open (the model's
``dashboard_watched`` key), ask the engine thread for a snapshot (``worker/core/scheduling/kv_snapshot.py``)
every ``interval_s`` and PUBLISH it, msgpack, on the model's dashboard channel, with what only the
I/O side knows (tokens sent, requests in flight, the queue's depth). Nobody watching: nothing is
taken and nothing sent, so the feed costs one EXISTS a tick. A gateway whose first dashboard opens
publishes on the model's wake channel (``listen``): the next snapshot is taken then, not at the
next tick, so a new page has its picture within a step. Watched, it takes at most
``ENGINE_SHARE`` of the engine thread: a snapshot that took ``t`` waits ``t / ENGINE_SHARE`` before
the next (a million-block pool: about 60 ms a snapshot, so one every 3 s; see docs/dashboard.md).

Pub/sub keeps nothing, and that is right here: a dashboard wants the latest picture, not a backlog.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import msgpack
import redis.asyncio as aioredis
import structlog

from pagedserve.runtime.queue_wait import MISSING, get_within
from pagedserve.runtime.redis_io import REDIS_DOWN, listen_forever
from pagedserve.shared.keys import Keys

log = structlog.get_logger("pagedserve.worker")
ENGINE_WAIT_S = 2.0  # a step longer than this: skip the tick rather than fall behind
ENGINE_SHARE = 0.02  # of the engine thread's time, at most, spent on snapshots


class DashboardPublisher:
    def __init__(self, redis: aioredis.Redis, keys: Keys, model: str, worker: str, interval_s: float,
                 ask: Callable[[], None], io_figures: Callable[[], dict]) -> None:
        self.redis, self.worker, self.interval_s = redis, worker, interval_s
        self.channel, self.watched = keys.dashboard(model), keys.dashboard_watched(model)
        self.wake_channel = keys.dashboard_wake(model)
        self.ask = ask  # asks the engine thread for a snapshot
        self.io_figures = io_figures
        self.loop: asyncio.AbstractEventLoop | None = None
        self._snapshots: asyncio.Queue[dict] = asyncio.Queue()
        self._woken = asyncio.Event()

    def from_engine_thread(self, snapshot: dict) -> None:
        self.loop.call_soon_threadsafe(self._snapshots.put_nowait, snapshot)

    async def listen(self, stop: asyncio.Event) -> None:
        """Wake ``run`` whenever a message comes on the model's wake channel."""
        await listen_forever(self.redis, self.wake_channel, lambda _data: self._woken.set(), stop=stop)

    async def run(self, stop: asyncio.Event) -> None:
        wait_s, rest_s = self.interval_s, 0.0  # rest_s: the engine's share after the last snapshot
        while not stop.is_set():
            started = time.monotonic()
            await _until_set(wait_s, stop, self._woken)
            woken = self._woken.is_set()
            if woken:  # at once, unless the engine's share says not yet
                await _until_set(rest_s - (time.monotonic() - started), stop)
                self._woken.clear()
            if stop.is_set():
                return
            try:
                if woken or await self.redis.exists(self.watched):
                    rest_s = await self._publish_one() / ENGINE_SHARE
                    wait_s = max(self.interval_s, rest_s)
                else:
                    wait_s = self.interval_s
            except REDIS_DOWN as err:  # the next tick tries again; the dashboard shows the gap
                log.warning("redis unavailable", during="dashboard", error=str(err))
                await asyncio.sleep(1.0)

    async def _publish_one(self) -> float:
        """Publish one snapshot; the seconds the engine thread spent taking it."""
        while not self._snapshots.empty():  # one that came too late for its tick
            self._snapshots.get_nowait()
        self.ask()
        snapshot = await get_within(self._snapshots, ENGINE_WAIT_S)
        if snapshot is MISSING:
            return 0.0
        snapshot.update(worker=self.worker, time=time.time(), **self.io_figures())
        await self.redis.publish(self.channel, msgpack.packb(snapshot))
        return snapshot["took_ms"] / 1000


async def _until_set(seconds: float, *events: asyncio.Event) -> None:
    """Sleep ``seconds``, or until one of ``events`` is set."""
    if seconds <= 0 or any(e.is_set() for e in events):
        return
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
