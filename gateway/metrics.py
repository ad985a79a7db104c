"""Prometheus metrics with vLLM-compatible names: latencies and token counts measured by the gateway,
queue and cache gauges summed over the model's workers (read from Redis at scrape time)."""

from __future__ import annotations

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from shared.keys import Keys

P = "pagedserve:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
WORKER_GAUGES = {  # name -> how to combine workers
    "num_requests_running": sum, "num_requests_waiting": sum, "num_requests_swapped": sum,
    "kv_cache_usage_perc": lambda values: sum(values) / len(values), "num_preemptions_total": sum,
    "prefix_cache_queries_total": sum, "prefix_cache_hits_total": sum,
}


class _WorkerSnapshot:
    """A collector that reports the last snapshot of the workers' metrics."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.values: dict[str, float] = {}

    def collect(self):
        for name, value in self.values.items():
            family = GaugeMetricFamily(P + name, f"{name.replace('_', ' ')} (all workers)", labels=["model_name"])
            family.add_metric([self.model], value)
            yield family


class GatewayMetrics:
    def __init__(self, redis: aioredis.Redis, keys: Keys, model: str) -> None:
        self.redis, self.keys, self.model = redis, keys, model
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram(P + "time_to_first_token_seconds", "time to first token", labels, registry=self.registry, buckets=LATENCY_BUCKETS)
        self.itl = Histogram(P + "inter_token_latency_seconds", "time between token events", labels, registry=self.registry, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "request latency", labels, registry=self.registry, buckets=LATENCY_BUCKETS)
        self.prompt_tokens = Counter(P + "prompt_tokens", "prompt tokens", labels, registry=self.registry)
        self.generation_tokens = Counter(P + "generation_tokens", "generated tokens", labels, registry=self.registry)
        self.requests = Counter(P + "request_success", "finished requests by reason", labels + ["finished_reason"], registry=self.registry)
        self.workers = _WorkerSnapshot(model)
        self.registry.register(self.workers)

    async def render(self) -> bytes:
        values: dict[str, list[float]] = {name: [] for name in WORKER_GAUGES}
        async for key in self.redis.scan_iter(match=self.keys.metrics(self.model, "*"), count=100):
            for name, raw in (await self.redis.hgetall(key)).items():
                if name.decode() in values:
                    values[name.decode()].append(float(raw))
        self.workers.values = {name: WORKER_GAUGES[name](v) for name, v in values.items() if v}
        return generate_latest(self.registry)
