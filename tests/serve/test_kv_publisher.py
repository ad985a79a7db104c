"""``worker/serve/kv_publisher.py`` on its own, against a real redis-server with no engine: what the
engine thread reports is merged and sent at the publisher's pace as one event, a resync is asked for
every ``resync_s`` and after Redis was lost, nothing goes out when nothing changed, and a leaving
worker says its cache is empty."""

from __future__ import annotations

import asyncio
import threading

import redis.asyncio as aioredis
from structlog.testing import capture_logs

from pagedserve.shared.keys import Keys
from pagedserve.shared.kv_wire import KvEvent
from pagedserve.worker.core.kv_cache.kv_events import KvChanges
from pagedserve.worker.serve import kv_publisher
from pagedserve.worker.serve.bridge import RedisBridge
from pagedserve.worker.serve.kv_publisher import KvPublisher
from tests.service_helpers import apoll

MODEL = "m"


async def events(redis) -> list[KvEvent]:
    return [KvEvent.decode(fields[b"data"]) for _, fields in await redis.xrange(Keys().kv_events(MODEL))]


class Publisher:
    """A publisher over a real bridge, recording the resyncs it asks for and its waits for Redis."""

    def __init__(self, redis, interval_s: float = 0.05, resync_s: float = 3600.0) -> None:
        self.resyncs, self.waits = 0, 0
        self.publisher = KvPublisher(RedisBridge(redis, Keys(), MODEL, "w1"), "w1", interval_s, resync_s,
                                     self._resync, self._redis_back)
        self.publisher.loop = asyncio.get_running_loop()
        self.stop = asyncio.Event()

    def _resync(self) -> None:
        self.resyncs += 1

    async def _redis_back(self) -> None:
        self.waits += 1

    def start(self) -> asyncio.Task:
        return asyncio.create_task(self.publisher.run(self.stop))


def run(redis_server, test):
    async def main():
        redis = aioredis.from_url(redis_server.url)
        try:
            return await test(redis)
        finally:
            await redis.aclose()
    return asyncio.run(main())


def test_what_the_engine_thread_reports_goes_out_merged_at_the_publishers_pace(redis_server):
    async def test(redis):
        p = Publisher(redis, interval_s=0.3)
        task = p.start()
        try:
            def engine_thread():  # two steps' worth, from another thread, before the first flush
                p.publisher.from_engine_thread(KvChanges([1, 2, 3], [], False))
                p.publisher.from_engine_thread(KvChanges([4], [2], False, [3]))

            thread = threading.Thread(target=engine_thread)
            thread.start()
            thread.join()
            await asyncio.sleep(0.05)
            assert await events(redis) == []  # not before the interval
            await apoll(lambda: _count(redis, 1), 10, "the first KV event")
            (event,) = await events(redis)
            assert (event.worker, sorted(event.published), event.dropped, event.reset, event.lowered) == ("w1", [1, 4], [2], False, [3])
            await asyncio.sleep(0.7)
            assert len(await events(redis)) == 1  # nothing changed: nothing sent
            p.publisher.from_engine_thread(KvChanges([9], [], True, [8]))
            await apoll(lambda: _count(redis, 2), 10, "the reset")
            assert (await events(redis))[1] == KvEvent("w1", [9], [], True, [8])
            assert p.resyncs == 0 and p.waits == 0
        finally:
            p.stop.set()
            await asyncio.wait_for(task, 5)

    run(redis_server, test)


async def _count(redis, n: int) -> bool:
    return len(await events(redis)) >= n


def test_a_resync_is_asked_for_every_resync_interval(redis_server):
    async def test(redis):
        p = Publisher(redis, interval_s=0.05, resync_s=0.5)
        task = p.start()
        try:
            await asyncio.sleep(0.3)
            assert p.resyncs == 0  # not at once: the service asks for the first itself
            await asyncio.sleep(0.9)
            assert 1 <= p.resyncs <= 3
        finally:
            p.stop.set()
            await asyncio.wait_for(task, 5)

    run(redis_server, test)


def test_with_redis_gone_it_says_why_waits_for_redis_and_then_asks_for_everything(redis_server):
    async def test(redis):
        p = Publisher(redis)
        task = p.start()
        try:
            await asyncio.to_thread(redis_server.stop)
            with capture_logs() as logs:
                p.publisher.from_engine_thread(KvChanges([1], [], False))
                await apoll(lambda: p.resyncs > 0, 10, "a resync after Redis was lost")
            said = [e for e in logs if e["event"] == "redis unavailable"]
            assert [(e["log_level"], e["during"]) for e in said] == [("warning", "kv events")]
            assert "connect" in said[0]["error"].lower() and p.waits == 1
        finally:
            p.stop.set()
            await asyncio.wait_for(task, 5)

    run(redis_server, test)


def test_a_leaving_worker_says_its_cache_is_empty_and_the_stream_stays_bounded(redis_server, monkeypatch):
    monkeypatch.setattr(kv_publisher, "KV_STREAM_LEN", 100)

    async def test(redis):
        p = Publisher(redis)
        for _ in range(250):
            await p.publisher.goodbye()
        got = await events(redis)
        assert got[-1] == KvEvent("w1", [], [], True) and 100 < len(got) < 250

    run(redis_server, test)
