"""``worker/serve/dashboard_publisher.py`` on its own, against a real redis-server, with a stand-in
for the engine thread's snapshot: nothing sent while nobody watches, snapshots at the tick while
the ``watched`` key is set, one at once on a wake however long the tick, never more than the
engine's share allows. ``tests/serve/test_dashboard_snapshots.py`` runs it inside a worker."""

from __future__ import annotations

import asyncio

import msgpack
import redis.asyncio as aioredis

from pagedserve.shared.keys import Keys
from pagedserve.worker.serve.dashboard_publisher import ENGINE_SHARE, DashboardPublisher

MODEL = "m"


def run_publisher(url: str, test, interval_s: float, took_ms: float = 1.0):
    """Run ``test(redis, snapshots, asked)`` while a publisher runs; ``snapshots`` is a pub/sub on
    the dashboard channel, ``asked`` counts the snapshots the publisher asked the engine for."""
    async def go():
        redis = aioredis.from_url(url)
        asked = []

        def ask():
            asked.append(1)
            publisher.from_engine_thread({"took_ms": took_ms, "figures": {"used": len(asked)}})

        publisher = DashboardPublisher(redis, Keys(), MODEL, "w1", interval_s, ask, lambda: {"tokens_out": 7})
        publisher.loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        async with redis.pubsub() as snapshots:
            await snapshots.subscribe(Keys().dashboard(MODEL))
            await snapshots.get_message(timeout=1)
            tasks = [asyncio.create_task(publisher.run(stop)), asyncio.create_task(publisher.listen(stop))]
            try:
                async with asyncio.timeout(10):  # a wake sent before the publisher listens would be lost
                    while (await redis.pubsub_numsub(Keys().dashboard_wake(MODEL)))[0][1] == 0:
                        await asyncio.sleep(0.02)
                return await test(redis, snapshots, asked)
            finally:
                stop.set()
                async with asyncio.timeout(5):  # both return by flag
                    await asyncio.gather(*tasks)
                await redis.aclose()
    return asyncio.run(go())


async def next_snapshot(snapshots, timeout: float) -> dict | None:
    try:
        async with asyncio.timeout(timeout):
            while (message := await snapshots.get_message(timeout=timeout)) is None:
                pass
    except TimeoutError:
        return None
    return msgpack.unpackb(message["data"])


async def wake(redis) -> None:
    await redis.publish(Keys().dashboard_wake(MODEL), b"1")


def test_a_wake_brings_a_snapshot_at_once_though_the_tick_is_an_hour(redis_server):
    async def test(redis, snapshots, asked):
        assert await next_snapshot(snapshots, 1.0) is None and not asked  # nobody watching, nobody woke it
        await wake(redis)
        snap = await next_snapshot(snapshots, 10.0)
        assert snap["worker"] == "w1" and snap["tokens_out"] == 7 and snap["figures"] == {"used": 1} and snap["time"] > 0
        assert await next_snapshot(snapshots, 1.0) is None and len(asked) == 1  # one wake, one snapshot
        await wake(redis)
        assert (await next_snapshot(snapshots, 10.0))["figures"] == {"used": 2}

    run_publisher(redis_server.url, test, interval_s=3600.0)


def test_snapshots_come_at_the_tick_while_watched_and_stop_when_the_key_goes(redis_server):
    async def test(redis, snapshots, asked):
        watched = Keys().dashboard_watched(MODEL)
        await redis.set(watched, b"1")
        got = [await next_snapshot(snapshots, 10.0) for _ in range(3)]
        assert [s["figures"]["used"] for s in got] == [1, 2, 3]
        await redis.delete(watched)
        await asyncio.sleep(0.3)  # a snapshot already asked for may still come
        while await next_snapshot(snapshots, 0.3) is not None:
            pass
        count = len(asked)
        assert await next_snapshot(snapshots, 1.0) is None and len(asked) == count

    run_publisher(redis_server.url, test, interval_s=0.05)


def test_a_wake_waits_for_the_engines_share_after_an_expensive_snapshot(redis_server):
    took_ms = 40.0  # the engine's share then allows the next one 2 s later

    async def test(redis, snapshots, asked):
        await wake(redis)
        assert await next_snapshot(snapshots, 10.0) is not None
        await wake(redis)
        assert await next_snapshot(snapshots, 0.2 * took_ms / 1000 / ENGINE_SHARE) is None  # not yet
        assert await next_snapshot(snapshots, 10.0) is not None  # then it comes

    run_publisher(redis_server.url, test, interval_s=3600.0, took_ms=took_ms)


def test_while_redis_is_down_it_says_so_and_publishes_again_once_it_is_back(redis_server):
    from structlog.testing import capture_logs

    async def go():
        redis = aioredis.from_url(redis_server.url)
        publisher = DashboardPublisher(redis, Keys(), MODEL, "w1", 0.05, lambda: publisher.from_engine_thread({"took_ms": 1.0}),
                                       lambda: {})
        publisher.loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        task = asyncio.create_task(publisher.run(stop))
        try:
            with capture_logs() as logs:
                await asyncio.to_thread(redis_server.stop)
                async with asyncio.timeout(10):
                    while not any(e["event"] == "redis unavailable" for e in logs):
                        await asyncio.sleep(0.05)
                await asyncio.to_thread(redis_server.start)
            said = next(e for e in logs if e["event"] == "redis unavailable")
            assert said["during"] == "dashboard" and said["log_level"] == "warning" and said["error"]
            async with redis.pubsub() as snapshots:  # a fresh server: watched again, and snapshots come
                await snapshots.subscribe(Keys().dashboard(MODEL))
                await snapshots.get_message(timeout=1)
                await redis.set(Keys().dashboard_watched(MODEL), b"1")
                assert (await next_snapshot(snapshots, 10.0))["worker"] == "w1"
            assert not task.done()
        finally:
            stop.set()
            async with asyncio.timeout(5):
                await task
            await redis.aclose()

    asyncio.run(go())
