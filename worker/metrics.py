"""The worker's own Prometheus endpoint (``--metrics-port``), with vLLM-compatible gauge names.

The same numbers go to Redis (``pagedserve:metrics:{model}:{consumer}``) for the gateway.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, start_http_server

PREFIX = "pagedserve:"


class WorkerMetrics:
    def __init__(self, port: int, model: str) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        self._gauges: dict[str, Gauge] = {}
        start_http_server(port, addr="0.0.0.0", registry=self.registry)

    def update(self, values: dict[str, float]) -> None:
        for name, value in values.items():
            gauge = self._gauges.get(name)
            if gauge is None:
                gauge = self._gauges[name] = Gauge(PREFIX + name, name.replace("_", " "), ["model_name"], registry=self.registry)
            gauge.labels(model_name=self.model).set(value)
