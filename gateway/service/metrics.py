"""Prometheus metrics with vLLM's V1 names and types: latencies and token counts measured by the
gateway, the workers' numbers (``runtime/metric_names.py``) combined over the model's workers, read
from Redis at scrape time."""

from __future__ import annotations

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedserve.gateway.dashboard.recent_latencies import RecentLatencies
from pagedserve.runtime.metric_names import SnapshotCollector, combine, is_worker_key
from pagedserve.shared.keys import Keys

V = "vllm:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    def __init__(self, redis: aioredis.Redis, keys: Keys, model: str) -> None:
        self.redis, self.keys, self.model = redis, keys, model
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram(V + "time_to_first_token_seconds", "time to first token", labels, registry=self.registry, buckets=LATENCY_BUCKETS)
        self.itl = Histogram(V + "inter_token_latency_seconds", "time between token events", labels, registry=self.registry, buckets=LATENCY_BUCKETS)
        self.queue_time = Histogram(V + "request_queue_time_seconds", "time from queued to first scheduled", labels,
                                    registry=self.registry, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram(V + "e2e_request_latency_seconds", "request latency", labels, registry=self.registry, buckets=LATENCY_BUCKETS)
        self.longest_gap = Histogram("pagedserve:request_longest_gap_seconds", "the longest wait between two token "
                                     "events a request saw (a long prompt's prefill pauses every stream beside it)",
                                     labels, registry=self.registry, buckets=LATENCY_BUCKETS)
        self.prompt_tokens = Counter(V + "prompt_tokens", "prompt tokens", labels, registry=self.registry)
        self.generation_tokens = Counter(V + "generation_tokens", "generated tokens", labels, registry=self.registry)
        self.requests = Counter(V + "request_success", "finished requests by reason", labels + ["finished_reason"], registry=self.registry)
        self.routed = Counter("pagedserve:routed_requests", "requests by where they were queued: a worker's own stream "
                              "(prefix routing) or the model's shared stream", labels + ["route"], registry=self.registry)
        self.open_requests = Gauge("pagedserve:gateway_open_requests", "requests this gateway waits on (one per "
                                   "prompt); none when nothing runs", registry=self.registry)
        self.recent = RecentLatencies()  # the dashboard's latency charts
        self.workers = SnapshotCollector(model)
        self.registry.register(self.workers)

    def first_token(self, model: str, seconds: float) -> None:
        self.ttft.labels(model).observe(seconds)
        self.recent.add("ttft", seconds)

    def next_token(self, model: str, seconds: float) -> None:
        self.itl.labels(model).observe(seconds)
        self.recent.add("itl", seconds)

    async def render(self) -> bytes:
        values: dict[str, list[float]] = {}
        async for key in self.redis.scan_iter(match=self.keys.metrics(self.model, "*"), count=100):
            for name, raw in (await self.redis.hgetall(key)).items():
                if is_worker_key(name.decode()):
                    values.setdefault(name.decode(), []).append(float(raw))
        self.workers.values = {name: combine(name, v) for name, v in values.items()}
        return generate_latest(self.registry)
