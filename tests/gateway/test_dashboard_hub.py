"""``gateway/dashboard/hub.py`` on its own, against a real redis-server and no worker: what a
first dashboard sets off (the ``watched`` key, the workers' wake), snapshots fanned out and kept
for the next page, bad messages skipped, the gateway's own frames, a slow page losing its oldest
frames, the feeds ended on close. The stack tests (``test_kv_dashboard.py``) show the same with a
worker behind it."""

from __future__ import annotations

import asyncio
import json

import msgpack
import pytest
import redis.asyncio as aioredis

from pagedserve.gateway.dashboard import hub as dashboard_hub
from pagedserve.gateway.dashboard.hub import FRAMES_QUEUED, DashboardHub
from pagedserve.gateway.dashboard.recent_latencies import RecentLatencies
from pagedserve.shared.keys import Keys
from tests.service_helpers import messages, subscribed

MODEL = "m"


def parse(frame: bytes) -> tuple[str, dict]:
    event, data = frame.decode().rstrip("\n").split("\n")
    return event.removeprefix("event: "), json.loads(data.removeprefix("data: "))


async def next_of(queue: asyncio.Queue, event: str, timeout: float = 10.0) -> dict:
    async with asyncio.timeout(timeout):
        while True:
            frame = await queue.get()
            assert frame is not None, "the feed ended"
            kind, payload = parse(frame)
            if kind == event:
                return payload


async def hub_subscribed(page: asyncio.Queue, redis) -> None:
    """The page's first frame, then the hub's subscription holding: the tick and the subscription
    are separate tasks, so a first frame alone does not mean a snapshot published now is heard."""
    await next_of(page, "gateway")
    channel = Keys().dashboard(MODEL)
    async with asyncio.timeout(10):
        while dict(await redis.pubsub_numsub(channel)).get(channel.encode(), 0) < 1:
            await asyncio.sleep(0.02)


def snapshot(worker: str, **figures) -> bytes:
    return msgpack.packb({"worker": worker, "figures": figures})


@pytest.fixture
def hub_run(redis_server):
    """Run ``test(hub, redis)`` on a hub over a fresh server."""
    def run(test, **settings):
        async def go():
            redis = aioredis.from_url(redis_server.url)
            hub = DashboardHub(redis, Keys(), MODEL, RecentLatencies())
            for name, value in settings.items():
                setattr(hub, name, value)
            try:
                return await test(hub, redis)
            finally:
                await hub.close()
                await redis.aclose()
        return asyncio.run(go())
    return run


def test_a_first_dashboard_marks_the_model_watched_and_wakes_its_workers(hub_run):
    async def test(hub, redis):
        keys = Keys()
        async with redis.pubsub() as wakes:
            await subscribed(wakes, keys.dashboard_wake(MODEL))
            async with hub.viewer():
                assert await messages(wakes, 1) == [b"1"]
                ttl = await redis.pttl(keys.dashboard_watched(MODEL))
                assert 0 < ttl <= dashboard_hub.WATCH_TTL_MS
                async with hub.viewer():  # a second page: the hub is subscribed already, no second wake
                    assert await wakes.get_message(timeout=1.5) is None

    hub_run(test)


def test_snapshots_reach_every_page_and_a_new_page_gets_each_workers_latest(hub_run):
    async def test(hub, redis):
        channel = Keys().dashboard(MODEL)
        async with hub.viewer() as first:
            await hub_subscribed(first, redis)
            for worker, used in (("w1", 1), ("w2", 5), ("w1", 2)):
                await redis.publish(channel, snapshot(worker, used=used))
            seen = [await next_of(first, "worker") for _ in range(3)]
            assert [(s["worker"], s["figures"]["used"]) for s in seen] == [("w1", 1), ("w2", 5), ("w1", 2)]
            async with hub.viewer() as second:  # at once, before any tick: the latest of each worker
                replayed = [parse(second.get_nowait()) for _ in range(second.qsize())]
                assert sorted((p["worker"], p["figures"]["used"]) for _, p in replayed) == [("w1", 2), ("w2", 5)]

    hub_run(test)


def test_a_worker_not_heard_from_is_not_replayed(hub_run, monkeypatch):
    monkeypatch.setattr(dashboard_hub, "STALE_S", 0.5)

    async def test(hub, redis):
        async with hub.viewer() as first:
            await hub_subscribed(first, redis)
            await redis.publish(Keys().dashboard(MODEL), snapshot("old", used=1))
            await next_of(first, "worker")
            await asyncio.sleep(0.6)
            async with hub.viewer() as second:
                assert second.empty()

    hub_run(test)


def test_messages_that_are_not_snapshots_are_skipped_said_once_and_the_feed_goes_on(hub_run):
    from structlog.testing import capture_logs

    async def test(hub, redis):
        channel = Keys().dashboard(MODEL)
        async with hub.viewer() as page:
            await hub_subscribed(page, redis)
            with capture_logs() as logs:
                for junk in (b"\x00not msgpack", msgpack.packb(7), msgpack.packb({"no": "worker"})):
                    await redis.publish(channel, junk)
                await redis.publish(channel, snapshot("w", used=3))
                assert (await next_of(page, "worker"))["figures"] == {"used": 3}
            said = [e for e in logs if e["event"] == "dashboard message skipped (logged once)"]
            assert len(said) == 1 and said[0]["log_level"] == "warning"
            with pytest.raises(Exception) as first:  # the first junk's own error is what is said
                msgpack.unpackb(b"\x00not msgpack")
            assert said[0]["error"] == str(first.value)[:200]

    hub_run(test)


def test_the_gateway_frame_carries_the_queue_depth_and_latencies(hub_run):
    async def test(hub, redis):
        await redis.xadd(Keys().requests(MODEL), {"data": b"x"})
        await redis.xadd(Keys().requests(MODEL), {"data": b"y"})
        async with hub.viewer() as page:
            frame = await next_of(page, "gateway")
            assert frame["queue_depth"] == 2 and set(frame) == {"time", "queue_depth", "ttft_ms", "itl_ms"}
            assert frame["ttft_ms"]["count"] == 0

    hub_run(test)


def test_a_page_that_reads_too_slowly_loses_its_oldest_frames(hub_run):
    async def test(hub, redis):
        channel, sent = Keys().dashboard(MODEL), FRAMES_QUEUED + 10
        async with hub.viewer() as page:
            await next_of(page, "gateway")
            for used in range(sent):
                await redis.publish(channel, snapshot("w", used=used))
            async with asyncio.timeout(10):  # a page opened now replays the last one: all have come
                while True:
                    async with hub.viewer() as probe:
                        latest = [parse(probe.get_nowait())[1] for _ in range(probe.qsize())]
                    if [snap["figures"]["used"] for snap in latest] == [sent - 1]:
                        break
                    await asyncio.sleep(0.05)
            frames = [parse(page.get_nowait()) for _ in range(page.qsize())]
            used = [payload["figures"]["used"] for kind, payload in frames if kind == "worker"]
            assert len(frames) == FRAMES_QUEUED and used[-1] == sent - 1 and used[0] > 0  # the newest kept
            assert used == list(range(used[0], sent))

    hub_run(test)


def test_a_hub_takes_a_hundred_pages_unless_told_otherwise(hub_run):
    async def test(hub, redis):
        assert hub.max_viewers == dashboard_hub.MAX_VIEWERS == 100 and not hub.full
        async with hub.viewer():
            assert not hub.full

    hub_run(test)


def test_close_ends_every_open_feed_and_a_full_hub_says_so(hub_run):
    async def test(hub, redis):
        async with hub.viewer() as first, hub.viewer() as second:
            assert hub.full
            await hub.close()
            for queue in (first, second):
                frames = [queue.get_nowait() for _ in range(queue.qsize())]
                assert frames[-1] is None
        assert not hub.full

    hub_run(test, max_viewers=2)


def test_the_last_page_closed_stops_renewing_the_watched_key(hub_run, monkeypatch):
    monkeypatch.setattr(dashboard_hub, "WATCH_TTL_MS", 400)

    async def test(hub, redis):
        watched = Keys().dashboard_watched(MODEL)
        async with hub.viewer() as page:
            await next_of(page, "gateway")
            assert await redis.exists(watched)
        async with asyncio.timeout(5):
            while await redis.exists(watched):
                await asyncio.sleep(0.1)

    hub_run(test)


def test_the_ticks_renew_the_watched_key_with_its_expiry_once_a_second(hub_run):
    async def test(hub, redis):
        async with hub.viewer() as page:
            ticks = [await next_of(page, "gateway") for _ in range(3)]  # the wake's set is long past
            ttl = await redis.pttl(Keys().dashboard_watched(MODEL))
            assert 0 < ttl <= dashboard_hub.WATCH_TTL_MS and await redis.get(Keys().dashboard_watched(MODEL)) == b"1"
            assert ticks[0]["time"] < ticks[1]["time"] < ticks[2]["time"]

    hub_run(test)


def test_while_redis_is_down_the_ticks_go_on_without_a_depth_and_say_why(hub_run, redis_server):
    from structlog.testing import capture_logs

    async def test(hub, redis):
        async with hub.viewer() as page:
            await hub_subscribed(page, redis)
            with capture_logs() as logs:
                await asyncio.to_thread(redis_server.stop)
                while (await next_of(page, "gateway"))["queue_depth"] is not None:
                    pass
            said = [e for e in logs if e["event"] == "redis unavailable" and e.get("during") == "dashboard"]
            assert said and said[0]["log_level"] == "warning" and "connect" in said[0]["error"].lower()

    hub_run(test)


def test_a_wake_sets_the_watched_key_for_its_expiry_and_publishes_the_wake(hub_run):
    """The wake on its own (the first tick would set the key too, so a viewer alone cannot tell)."""
    async def test(hub, redis):
        keys = Keys()
        async with redis.pubsub() as wakes:
            await subscribed(wakes, keys.dashboard_wake(MODEL))
            await hub._wake()
            assert await messages(wakes, 1) == [b"1"]
        assert await redis.get(keys.dashboard_watched(MODEL)) == b"1"
        assert 0 < await redis.pttl(keys.dashboard_watched(MODEL)) <= dashboard_hub.WATCH_TTL_MS

    hub_run(test)


def test_a_wake_with_redis_gone_says_why_and_does_not_raise(hub_run, redis_server):
    """Redis dropping between the subscription and the wake: a warning, the ticks carry on."""
    from structlog.testing import capture_logs

    async def test(hub, redis):
        await asyncio.to_thread(redis_server.stop)
        with capture_logs() as logs:
            await hub._wake()
        said = [e for e in logs if e["event"] == "redis unavailable"]
        assert [(e["log_level"], e["during"]) for e in said] == [("warning", "dashboard wake")]
        assert "connect" in said[0]["error"].lower()

    hub_run(test)
