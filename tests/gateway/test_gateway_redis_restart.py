"""A Redis restart (without persistence) costs the gateway no spurious 503s once Redis answers:
pooled connections that died with it are retried on fresh ones; an open KV dashboard's feed
carries on once the gateway has subscribed again and the worker sees the dashboard watched."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import httpx
import redis

from pagedserve.embedded_redis import RedisServer
from pagedserve.shared.keys import Keys
from pagedserve.worker.engine import Engine
from pagedserve.worker.setup.engine_config import EngineConfig
from tests.gateway.dashboard_feed import frames
from tests.gateway_stack import Stack
from tests.service_helpers import MODEL_NAME, poll


def test_requests_after_a_redis_restart_are_served(zoo, tmp_path):
    server = RedisServer(tmp_path).start()
    engine = Engine(EngineConfig(model=str(zoo.path("llama-gqa")), device="cpu", dtype="float32", num_gpu_blocks=256))
    stack = Stack(server, engine, zoo.path("llama-gqa")).start()
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}

    async def burst(count: int) -> list[int]:  # concurrent, so the gateway's pool holds many connections
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
            return [r.status_code for r in await asyncio.gather(*(http.post("/v1/completions", json=body)
                                                                    for _ in range(count)))]

    try:
        assert asyncio.run(burst(30)) == [200] * 30
        server.stop()
        server.start()  # same port, empty: the worker recreates its group and beats again
        alive = redis.Redis.from_url(server.url)
        poll(lambda: alive.exists(Keys().alive(MODEL_NAME, "test-worker")), 30, "the worker's heartbeat")
        alive.close()
        assert asyncio.run(burst(30)) == [200] * 30
    finally:
        stack.stop()
        server.stop()


def test_an_open_dashboard_comes_back_after_a_redis_restart(zoo, tmp_path):
    server = RedisServer(tmp_path).start()
    engine = Engine(EngineConfig(model=str(zoo.path("llama-gqa")), device="cpu", dtype="float32", num_gpu_blocks=256))
    stack = Stack(server, engine, zoo.path("llama-gqa")).start()

    async def watch() -> float:
        async with aiohttp.ClientSession() as http:
            async with http.get(stack.url + "/dashboard/events") as feed:
                restarted = None
                async with asyncio.timeout(60):
                    async for event, snap in frames(feed):
                        if event != "worker":
                            continue
                        if restarted is None:  # live: now lose Redis (its keys and subscriptions with it)
                            await asyncio.to_thread(server.stop)
                            await asyncio.to_thread(server.start)
                            restarted = time.time()
                        elif snap["time"] > restarted:
                            return snap["time"] - restarted

    try:
        assert asyncio.run(watch()) < 30  # the same feed, without the page reconnecting
    finally:
        stack.stop()
        server.stop()
