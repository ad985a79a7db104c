"""The worker's own Prometheus endpoint (``--metrics-port``), with vLLM's names and types
(``shared.metric_names``).

The same numbers go to Redis (``pagedserve:{model}:metrics:{consumer}``) for the gateway.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server

from shared.metric_names import SnapshotCollector


class WorkerMetrics:
    def __init__(self, port: int, model: str, host: str = "127.0.0.1") -> None:
        self.registry = CollectorRegistry()
        self._snapshot = SnapshotCollector(model)
        self.registry.register(self._snapshot)
        start_http_server(port, addr=host, registry=self.registry)

    def update(self, values: dict[str, float]) -> None:
        self._snapshot.values = dict(values)


def engine_state(engine) -> dict[str, float]:
    """The engine's numbers. Read on the engine thread only: the I/O thread gets a copy."""
    sched = engine.scheduler
    usage = sched.blocks.usage()
    return {
        "num_requests_running": len(sched.running), "num_requests_waiting": len(sched.waiting),
        "num_requests_swapped": len(sched.swapped), "kv_cache_usage_perc": usage.used / max(1, usage.total),
        "num_preemptions_total": sched.stats.num_preemptions,
        "prefix_cache_queries_total": sched.stats.prefix_query_tokens,
        "prefix_cache_hits_total": sched.stats.prefix_hit_tokens, "cow_copies_total": sched.stats.cow_copies,
        "kv_blocks_saved_by_sharing": usage.logical - usage.used,
        "max_model_len": sched.config.max_model_len,  # the gateway checks prompts against it
        # what the gateway's router needs: how to hash a prompt's blocks as this worker does, and its capacity
        "block_size": sched.config.block_size, "rope_switch": sched.config.rope_switch,
        "max_num_seqs": sched.config.max_num_seqs,
    }


def worker_metrics(state: dict[str, float], in_flight: int, queued: int, tokens_out: int,
                   tokens_per_s: float) -> dict[str, float]:
    """The engine's last snapshot with the I/O side's numbers: queue, in flight, tokens sent."""
    return {**state, "num_requests_waiting": state.get("num_requests_waiting", 0) + queued, "in_flight": in_flight,
            "generation_tokens_total": tokens_out, "generation_tokens_per_s": round(tokens_per_s, 2)}
