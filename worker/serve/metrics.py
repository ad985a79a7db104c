"""The worker's own Prometheus endpoint (``--metrics-port``), with vLLM's names and types
(``runtime/metric_names.py``).

The same numbers go to Redis (``pagedserve:{model}:metrics:{consumer}``) for the gateway.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server

from pagedserve.runtime.metric_names import SnapshotCollector


class WorkerMetrics:
    def __init__(self, port: int, model: str, host: str = "127.0.0.1", limits: dict | None = None) -> None:
        """``limits``: the engine's (``Engine.limits()``), for ``vllm:cache_config_info``."""
        self.registry = CollectorRegistry()
        self._snapshot = SnapshotCollector(model, limits)
        self.registry.register(self._snapshot)
        start_http_server(port, addr=host, registry=self.registry)

    def update(self, values: dict[str, float]) -> None:
        self._snapshot.values = dict(values)


def worker_metrics(state: dict[str, float], in_flight: int, queued: int, tokens_out: int,
                   tokens_per_s: float) -> dict[str, float]:
    """The engine's last snapshot with the I/O side's numbers: queue, in flight, tokens sent."""
    return {**state, "num_requests_waiting": state.get("num_requests_waiting", 0) + queued, "in_flight": in_flight,
            "generation_tokens_total": tokens_out, "generation_tokens_per_s": round(tokens_per_s, 2)}
