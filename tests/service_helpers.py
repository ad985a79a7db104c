"""Helpers for the service tests: an in-process worker on a real Redis, and event collection."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from shared.protocol import WireEvent
from shared.settings import WorkerSettings

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
    from worker.serve.service import WorkerService

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


async def collect(stream, on_event=None) -> Collected:
    got = Collected()
    async for event in stream:
        got.events.append(event)
        if on_event is not None:
            await on_event(event)
    return got
