"""What a worker says about itself, on its I/O thread: its metrics (the Redis hash, Prometheus, the
stats line), the ``WorkerInfo`` the gateways route and admit by, and the KV dashboard's figures."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from pagedserve.shared.worker_info import WorkerInfo
from pagedserve.worker.serve.inflight import InFlightTable
from pagedserve.worker.serve.loop import EngineLoop
from pagedserve.worker.serve.metrics import worker_metrics


class SelfReport:
    def __init__(self, name: str, model: str, limits: dict[str, int], inflight: InFlightTable, engine_loop: EngineLoop,
                 stopping: asyncio.Event, adapters: Callable[[], tuple[str, ...]] | None = None) -> None:
        """``limits``: the engine's, fixed while it runs (``Engine.limits()``); ``adapters``: the LoRA
        adapters it holds now (they change at run time), else the limits' own."""
        self.name, self.model, self.limits, self.adapters = name, model, limits, adapters
        self.inflight, self.engine_loop, self.stopping = inflight, engine_loop, stopping
        self.queue_depth = 0  # the model's stream, as the last upkeep read it
        self._rate_mark = (time.monotonic(), 0)

    def metrics(self) -> dict:
        """The engine thread's last snapshot with the I/O side's numbers; the token rate since the last call."""
        now, sent = time.monotonic(), self.inflight.tokens_out
        (then, count), self._rate_mark = self._rate_mark, (now, sent)
        rate = (sent - count) / max(1e-6, now - then)
        return worker_metrics(self.engine_loop.snapshot, len(self.inflight), self.engine_loop.queued, sent, rate)

    def worker_info(self, metrics: dict) -> WorkerInfo:
        """The engine's limits and, from ``metrics``, its load."""
        limits = self.limits if self.adapters is None else {**self.limits, "adapters": self.adapters()}
        return WorkerInfo(self.name, self.model, **limits, running=int(metrics.get("num_requests_running", 0)),
                          waiting=int(metrics.get("num_requests_waiting", 0)), draining=self.stopping.is_set())

    def dashboard_figures(self) -> dict:
        return {"tokens_out": self.inflight.tokens_out, "in_flight": len(self.inflight), "queue_depth": self.queue_depth,
                "draining": self.stopping.is_set()}
