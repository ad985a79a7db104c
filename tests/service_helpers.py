"""Helpers for the service tests: an in-process worker on a real Redis, and event collection."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from pagedserve.shared.protocol import WireEvent
from pagedserve.worker.serve.settings import WorkerSettings

MODEL_NAME = "tiny"


def settings_for(url: str, model_path, **overrides) -> WorkerSettings:
    base = dict(
        model=str(model_path), redis_url=url, served_model_name=MODEL_NAME, consumer="test-worker",
        max_inflight=64, claim_idle_ms=2000, heartbeat_s=0.2, max_deliveries=3, drain_timeout_s=30.0,
        key_prefix="pagedserve", engine=dict(dtype="float32", num_gpu_blocks=1024, max_num_seqs=64),
    )
    base.update(overrides)
    return WorkerSettings(**base)


@contextlib.asynccontextmanager
async def running_worker(settings: WorkerSettings, engine):
    from pagedserve.worker.serve.service import WorkerService

    service = WorkerService(settings, engine)
    task = asyncio.create_task(service.run())
    try:
        yield service
    finally:
        service.request_stop()
        assert await asyncio.wait_for(task, 60) == 0


@dataclass
class Collected:
    events: list[WireEvent] = field(default_factory=list)

    @property
    def last(self) -> WireEvent:
        return self.events[-1]

    def tokens(self, index: int = 0) -> list[int]:
        return [t for e in self.events for o in e.outputs if o.index == index for t in o.token_ids]

    def text(self, index: int = 0) -> str:
        return "".join(o.text for e in self.events for o in e.outputs if o.index == index)


REPLY_TIMEOUT_S = 60.0  # a request's whole stream in these tests; past it, a clear failure, not a hang


async def collect(stream, on_event=None, timeout: float = REPLY_TIMEOUT_S) -> Collected:
    """Every event of one request's stream, ending with its terminal one; an AssertionError saying
    what came when it does not end within ``timeout`` seconds."""
    got = Collected()
    try:
        async with asyncio.timeout(timeout):
            async for event in stream:
                got.events.append(event)
                if on_event is not None:
                    await on_event(event)
    except TimeoutError:
        seen = f"the last seq {got.events[-1].seq}" if got.events else "nothing"
        raise AssertionError(f"no terminal event within {timeout} s: {len(got.events)} events came, {seen}") from None
    return got


async def events_of(box, timeout: float = REPLY_TIMEOUT_S) -> list[WireEvent]:
    """A mailbox's events (``runtime/mailbox.py``), as ``collect`` gathers a stream's."""
    return (await collect(box.events(), timeout=timeout)).events


class ChannelTap:
    """Records every message on pub/sub channels matching some patterns: what crossed Redis, for
    asserting that a cancel was sent and how a request really ended. Runs on the loop that starts it."""

    def __init__(self, url: str, *patterns: str) -> None:
        import redis.asyncio as aioredis

        self.redis = aioredis.from_url(url)
        self.patterns = patterns
        self.messages: list[tuple[str, bytes]] = []
        self._task = None

    async def start(self) -> "ChannelTap":
        self.pubsub = self.redis.pubsub()
        await self.pubsub.psubscribe(*self.patterns)
        self._task = asyncio.create_task(self._read())
        return self

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.pubsub.aclose()
        await self.redis.aclose()

    async def _read(self) -> None:
        while True:
            msg = await self.pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if msg is not None:
                self.messages.append((msg["channel"].decode(), msg["data"]))

    def events(self, request_id: str) -> list[WireEvent]:
        from pagedserve.shared.protocol import decode_events

        return [e for channel, data in list(self.messages) if ":replies:" in channel
                for e in decode_events(data) if e.id == request_id]

    def cancels(self) -> list:
        from pagedserve.shared.protocol import WireCancel

        return [WireCancel.decode(data) for channel, data in list(self.messages) if ":cancel:" in channel]


def poll(condition, timeout: float, what: str, interval: float = 0.05) -> None:
    """Wait until ``condition()`` is true; fail with ``what`` after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


async def apoll(condition, timeout: float, what: str, interval: float = 0.05) -> None:
    """``poll`` for coroutines: the event loop keeps running while it waits; ``condition`` may be
    a coroutine function (e.g. a Redis query)."""
    deadline = asyncio.get_running_loop().time() + timeout

    async def holds() -> bool:
        result = condition()
        return bool(await result) if asyncio.iscoroutine(result) else bool(result)

    while not await holds():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)


async def subscribed(pubsub, channel: str) -> None:
    """Subscribe ``pubsub`` to ``channel`` and wait for Redis to confirm it (what is published before
    the confirmation is not heard)."""
    await pubsub.subscribe(channel)
    async with asyncio.timeout(10):
        while (await pubsub.get_message(timeout=1.0)) is None:
            pass


async def messages(pubsub, count: int, timeout: float = 10.0) -> list[bytes]:
    """The next ``count`` messages' payloads on ``pubsub``; a clear failure after ``timeout``."""
    got: list[bytes] = []
    async with asyncio.timeout(timeout):
        while len(got) < count:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message is not None:
                got.append(message["data"])
    return got
