"""The KV dashboard over the whole stack: a real worker publishes snapshots while a dashboard is
open, the gateway fans them out as SSE; forks, beams and a shared system prompt show their blocks
with the right refcounts; the feed follows the API-key rule and ends cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import msgpack
import redis.asyncio as aioredis

from pagedserve.gateway.service.generation import STATE
from pagedserve.shared.keys import Keys
from pagedserve.worker.core.kv_cache.pool_map import decode
from tests.core.test_kv_snapshot import assert_values_count_the_tables
from tests.gateway.dashboard_feed import LOAD, frames, hold_load


def shows_every_kind_of_sharing(snap: dict) -> bool:
    """True once one snapshot holds all four requests, each sharing as it must, every block's value
    being exactly 1 + the tables that name it."""
    cells, group = decode(snap["gpu"])
    rows = {}
    for row in snap["requests"]:
        rows.setdefault(row["prompt"], []).append(row)
    if set(rows) != set(LOAD) or snap["unlisted"] or any(r["state"] != "running" for r in snap["requests"]):
        return False
    assert group == 1 and not any(r["cut"] for r in snap["requests"])
    assert_values_count_the_tables(cells, snap["requests"])
    (fork,), (beams,), (a,), (b,) = rows[20], rows[21], rows[49], rows[50]
    if len(fork["tables"]) != 3 or len(beams["tables"]) != 2:
        return False  # not forked yet
    first = {t[0] for t in fork["tables"]}
    assert len(first) == 1 and cells[first.pop()] == 4  # the prompt's full block, held by three samples
    assert beams["tables"][0][0] == beams["tables"][1][0] and cells[beams["tables"][0][0]] == 3
    shared = a["tables"][0][:3]
    assert shared == b["tables"][0][:3] and [cells[x] for x in shared] == [3, 3, 3]  # one system prompt, stored once
    return True


async def watch(base: str, until, timeout: float, headers=None) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.get(base + "/dashboard/events", headers=headers) as feed:
            assert feed.status == 200 and feed.content_type == "text/event-stream"
            load = asyncio.create_task(hold_load(http, base, headers=headers))
            try:
                async with asyncio.timeout(timeout):
                    async for event, payload in frames(feed):
                        assert not load.done() or load.exception() is None, load.exception()
                        if event == "worker" and until(payload):
                            return payload
            finally:
                load.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await load


def test_the_feed_shows_forks_beams_and_a_shared_prompt_with_their_refcounts(stack):
    snap = asyncio.run(watch(stack.url, shows_every_kind_of_sharing, timeout=90))
    figures = snap["figures"]
    assert figures["logical"] > figures["used"] > 0 and snap["worker"] == "test-worker"
    assert snap["tokens_out"] > 0 and figures["prefix_hit_tokens"] >= 48


def test_the_feed_follows_the_api_key_rule_and_the_page_is_served(stack):
    keyed = stack.add_gateway(api_keys=("dash-key",))

    async def go():
        async with aiohttp.ClientSession() as http:
            async with http.get(keyed + "/dashboard/events") as refused:
                assert refused.status == 401
            async with http.get(keyed + "/dashboard/events", headers={"Authorization": "Bearer wrong"}) as refused:
                assert refused.status == 401
            for path, kind in (("/dashboard", "text/html"), ("/dashboard/app.js", "text/javascript"),
                               ("/dashboard/draw.js", "text/javascript"), ("/dashboard/app.css", "text/css")):
                async with http.get(keyed + path) as page:  # no data in them: open
                    assert page.status == 200 and page.content_type == kind
                    assert len(await page.read()) > 500

    asyncio.run(go())
    snap = asyncio.run(watch(keyed, lambda s: bool(s["requests"]), timeout=60, headers={"Authorization": "Bearer dash-key"}))
    assert snap["figures"]["total"] == 1024


def test_nobody_watching_means_nothing_published(stack):
    async def go():
        worker = stack.worker
        watched = worker.keys.dashboard_watched("tiny")
        async with aiohttp.ClientSession() as http:
            async with http.get(stack.url + "/dashboard/events") as feed:
                async with asyncio.timeout(10):
                    async for event, _ in frames(feed):
                        if event == "gateway":
                            break
                assert await worker.redis.exists(watched)
        async with asyncio.timeout(10):  # the last viewer left: the key lapses within its expiry
            while await worker.redis.exists(watched):
                await asyncio.sleep(0.2)

    stack.run(go())


def test_a_new_dashboard_has_a_snapshot_at_once_not_at_the_workers_next_look(stack):
    """Here the worker looks at the ``watched`` key once an hour: a first frame can only come from
    the wake the gateway publishes when its first dashboard opens."""
    publisher, url = stack.worker.dashboard, stack.add_gateway()  # a new hub: no snapshot kept from before
    interval_s, publisher.interval_s = publisher.interval_s, 3600.0

    async def first_worker_frame() -> float:
        await asyncio.sleep(1.0)  # the publisher's tick now waits an hour
        async with aiohttp.ClientSession() as http:
            started = time.monotonic()
            async with http.get(url + "/dashboard/events") as feed:
                async with asyncio.timeout(20):
                    async for event, payload in frames(feed):
                        if event == "worker":
                            assert payload["worker"] == "test-worker" and payload["figures"]["total"] == 1024
                            return time.monotonic() - started

    try:
        print(f"first worker frame after {1000 * asyncio.run(first_worker_frame()):.0f} ms")
    finally:
        publisher.interval_s = interval_s  # the next dashboard's wake brings the worker back to its pace


def test_a_bad_message_on_the_channel_is_skipped_and_the_feed_goes_on(stack):
    async def go():
        redis = aioredis.from_url(stack.redis.url)
        async with aiohttp.ClientSession() as http:
            async with http.get(stack.url + "/dashboard/events") as feed:
                load = asyncio.create_task(hold_load(http, stack.url, max_tokens=50))
                try:
                    workers = 0
                    async with asyncio.timeout(30):
                        async for event, payload in frames(feed):
                            if event == "gateway":  # subscribed by now: spoil the channel
                                for junk in (b"\x00not msgpack", msgpack.packb(7), msgpack.packb({"worker": b"\xff"}),
                                             msgpack.packb({"no": "worker"})):
                                    await redis.publish(Keys().dashboard("tiny"), junk)
                            elif event == "worker":
                                assert isinstance(payload["figures"], dict)  # only real snapshots come out
                                workers += 1
                                if workers == 3:
                                    break
                finally:
                    load.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await load
                    await redis.aclose()

    asyncio.run(go())


def test_a_gateway_shutting_down_ends_open_feeds_at_once(stack):
    url = stack.add_gateway()
    runner = stack.runners.pop()

    async def go():
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/dashboard/events") as feed:
                async for event, _ in frames(feed):
                    break
                shutdown = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(runner.cleanup(), stack.loop))
                async with asyncio.timeout(10):  # a feed left open holds the shutdown for its 60 s grace
                    async for _ in frames(feed):
                        pass
                    await shutdown

    asyncio.run(go())


def test_dashboards_past_the_limit_are_refused_with_503_and_a_freed_place_is_taken(stack):
    url = stack.add_gateway()
    stack.runners[-1].app[STATE].dashboard.max_viewers = 2

    async def go():
        async with aiohttp.ClientSession() as http:
            first = await http.get(url + "/dashboard/events")
            second = await http.get(url + "/dashboard/events")
            async with http.get(url + "/dashboard/events") as third:
                assert (first.status, second.status, third.status) == (200, 200, 503)
                assert third.headers["Retry-After"] == "10"
                assert (await third.json())["error"]["code"] == "too_many_dashboards"
            first.close()  # its handler sees the client gone and leaves its place
            async with asyncio.timeout(10):
                while True:
                    async with http.get(url + "/dashboard/events") as again:
                        if again.status == 200:
                            break
                    await asyncio.sleep(0.1)
            second.close()

    asyncio.run(go())
