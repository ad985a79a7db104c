"""The gateway's side of the KV dashboard: one Redis subscription to the model's dashboard channel,
fanned out to every open dashboard as ready-made SSE frames.

While at least one dashboard is open the hub renews the model's ``dashboard_watched`` key (workers
publish snapshots only then), and once a second it sends a ``gateway`` frame: this gateway's
time-to-first-token and inter-token percentiles over the last ten seconds and the model's queue
depth. ``worker`` frames are the workers' snapshots as JSON (``worker/core/scheduling/kv_snapshot.py``); a
new dashboard gets each live worker's latest at once. Once subscribed (the first dashboard, or
again after a lost connection) the hub sets the ``watched`` key and publishes on the model's wake
channel, so the workers send a snapshot then rather than at their next look at the key. A dashboard that reads too slowly loses its
oldest frames, never holds up the others; a message that does not decode is logged and skipped.
Both of the hub's tasks run supervised: a failure is logged and retried, and one that keeps
failing ends the open feeds (their pages reconnect) instead of leaving them silent.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgpack
import redis.asyncio as aioredis
import structlog

from pagedserve.gateway.dashboard.recent_latencies import RecentLatencies
from pagedserve.gateway.http.sse import frame as sse
from pagedserve.runtime.redis_io import REDIS_DOWN, listen_forever, stop_tasks
from pagedserve.runtime.supervision import supervise
from pagedserve.shared.keys import Keys

log = structlog.get_logger("pagedserve.gateway")
WATCH_TTL_MS = 3000  # a gateway gone without a word stops the snapshots within this
TICK_S = 1.0
FRAMES_QUEUED = 64  # per dashboard, before its oldest frames are dropped (a few seconds of 16 workers)
MAX_VIEWERS = 100  # open dashboards per gateway; one more is a 503
STALE_S = 10.0  # a worker not heard from for this long is not replayed to a new dashboard


class DashboardHub:
    def __init__(self, redis: aioredis.Redis, keys: Keys, model: str, latencies: RecentLatencies) -> None:
        self.redis, self.keys, self.model, self.latencies = redis, keys, model, latencies
        self._viewers: set[asyncio.Queue[bytes | None]] = set()
        self._latest: dict[str, tuple[float, bytes]] = {}  # worker -> (when, frame)
        self._tasks: list[asyncio.Task] = []
        self._wakes: set[asyncio.Task] = set()
        self._stop = asyncio.Event()
        self._bad_seen = False
        self.max_viewers = MAX_VIEWERS

    @property
    def full(self) -> bool:
        return len(self._viewers) >= self.max_viewers

    @contextlib.asynccontextmanager
    async def viewer(self):
        """A queue of SSE frames for one open dashboard; ``None`` in it means the gateway is closing."""
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(FRAMES_QUEUED)
        now = time.monotonic()
        for when, frame in self._latest.values():
            if now - when < STALE_S:
                self._send(queue, frame)
        self._viewers.add(queue)
        if not self._tasks:
            # A fresh flag each time: tasks of a previous viewer may still be stopping on theirs.
            stop = self._stop = asyncio.Event()
            channel = self.keys.dashboard(self.model)
            self._tasks = [asyncio.create_task(supervise(name, run, self._give_up)) for name, run in (
                ("dashboard feed", lambda: listen_forever(self.redis, channel, self._message,
                                                          on_subscribed=self._wake_workers, stop=stop)),
                ("dashboard tick", lambda: self._tick(stop)))]
        try:
            yield queue
        finally:
            self._viewers.discard(queue)
            if not self._viewers:
                await self._stop_tasks()

    async def close(self) -> None:
        """The gateway is stopping: every open dashboard's stream ends."""
        self._fan_out(None)
        await self._stop_tasks()

    async def _stop_tasks(self) -> None:
        tasks, self._tasks = self._tasks + list(self._wakes), []
        if tasks:
            await stop_tasks(tasks, self._stop)

    def _wake_workers(self) -> None:
        """Subscribed: ask the workers for a snapshot now (the feed's task must not wait on it)."""
        task = asyncio.get_running_loop().create_task(self._wake())
        self._wakes.add(task)
        task.add_done_callback(self._wakes.discard)

    async def _wake(self) -> None:
        try:
            await self.redis.set(self.keys.dashboard_watched(self.model), b"1", px=WATCH_TTL_MS)
            await self.redis.publish(self.keys.dashboard_wake(self.model), b"1")
        except REDIS_DOWN as err:  # the tick renews the key; the workers see it at their next look
            log.warning("redis unavailable", during="dashboard wake", error=str(err))

    def _give_up(self, task: str) -> None:
        """A hub task that keeps failing (logged by ``supervise``): end the open feeds, so their
        pages reconnect and start it afresh, rather than show a dashboard that never changes."""
        self._fan_out(None)

    def _message(self, data: bytes) -> None:
        try:
            snapshot = msgpack.unpackb(data)
            worker = str(snapshot["worker"])
            frame = sse(snapshot, "worker")
        except Exception as err:  # anyone can publish on a channel: a bad message must not end the feed
            if not self._bad_seen:
                log.warning("dashboard message skipped (logged once)", error=str(err)[:200])
                self._bad_seen = True
            return
        now = time.monotonic()
        self._latest = {w: seen for w, seen in self._latest.items() if now - seen[0] < STALE_S}
        self._latest[worker] = (now, frame)
        self._fan_out(frame)

    async def _tick(self, stop: asyncio.Event) -> None:
        watched, stream = self.keys.dashboard_watched(self.model), self.keys.requests(self.model)
        while not stop.is_set():
            try:
                await self.redis.set(watched, b"1", px=WATCH_TTL_MS)
                depth = await self.redis.xlen(stream)
            except REDIS_DOWN as err:
                log.warning("redis unavailable", during="dashboard", error=str(err))
                depth = None
            self._fan_out(sse({"time": time.time(), "queue_depth": depth, "ttft_ms": self.latencies.percentiles("ttft"),
                               "itl_ms": self.latencies.percentiles("itl")}, "gateway"))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), TICK_S)

    def _fan_out(self, frame: bytes | None) -> None:
        for queue in self._viewers:
            self._send(queue, frame)

    @staticmethod
    def _send(queue: asyncio.Queue, frame: bytes | None) -> None:
        if queue.full():
            queue.get_nowait()
        queue.put_nowait(frame)
