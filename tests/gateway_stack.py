"""A whole stack for gateway tests: redis-server, an in-process worker with the real engine, and
gateways on free ports, all on one event loop in a background thread (so tests can use the
synchronous openai SDK)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field, replace
from typing import Iterator

from aiohttp import web

from pagedserve.embedded_redis import RedisServer, free_port
from pagedserve.gateway.app import create_app
from pagedserve.gateway.service.settings import GatewaySettings
from tests.service_helpers import MODEL_NAME, settings_for


def gateway_settings(redis_url: str, model_path, **overrides) -> GatewaySettings:
    base = GatewaySettings(
        model=str(model_path), served_model_name=MODEL_NAME, redis_url=redis_url, host="127.0.0.1", port=free_port(),
        gateway_id=f"gw-{free_port()}", api_keys=(), max_body_bytes=1 << 20, max_queue_depth=1000, request_timeout_s=60.0,
        max_n=16, max_tokens=1024, default_chat_max_tokens=24, cors_origins=(), key_prefix="pagedserve",
    )
    return replace(base, **overrides)


@dataclass
class Stack:
    redis: RedisServer
    engine: object
    model_path: object
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    runners: list = field(default_factory=list)
    worker_overrides: dict = field(default_factory=dict)  # WorkerSettings fields

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> "Stack":
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def up():
            from pagedserve.worker.serve.service import WorkerService

            # The gateways share this loop with the worker's I/O: under a burst of streams a 0.6 s
            # liveness key (3 x 0.2 s heartbeats) can lapse and the gateway answers 503 "no worker".
            settings = settings_for(self.redis.url, self.model_path, **{"heartbeat_s": 1.0, "claim_idle_ms": 5000,
                                                                        **self.worker_overrides})
            self.worker = WorkerService(settings, self.engine)
            self.worker_task = asyncio.create_task(self.worker.run())
            while not await self.worker.redis.exists(self.worker.keys.alive(MODEL_NAME, "test-worker")):
                await asyncio.sleep(0.05)

        self.run(up())
        self.url = self.add_gateway()
        return self

    def add_gateway(self, **overrides) -> str:
        settings = gateway_settings(**{"redis_url": self.redis.url, **overrides}, model_path=self.model_path)

        async def up():
            runner = web.AppRunner(create_app(settings), handler_cancellation=True)
            await runner.setup()
            await web.TCPSite(runner, settings.host, settings.port).start()
            self.runners.append(runner)

        self.run(up())
        return f"http://127.0.0.1:{settings.port}"

    def stop(self) -> None:
        async def down():
            for runner in self.runners:
                await runner.cleanup()
            self.worker.request_stop()
            await self.worker_task

        self.run(down())
        self.loop.call_soon_threadsafe(self.loop.stop)


@contextlib.contextmanager
def running_stack(tmp_path_factory, model_path, **engine_options) -> Iterator[Stack]:
    """A redis-server, an in-process worker with the real engine (float32 on the CPU, ``engine_options``
    beside) and a gateway, stopped after."""
    from pagedserve.worker.engine import Engine
    from pagedserve.worker.setup.engine_config import EngineConfig

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    engine = Engine(EngineConfig(model=str(model_path), device="cpu", dtype="float32", **engine_options))
    try:
        stack = Stack(server, engine, model_path).start()
        yield stack
        stack.stop()
    finally:
        server.stop()
