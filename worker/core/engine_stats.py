"""The engine's numbers as the serve layer reports them (vLLM's metric names,
``runtime/metric_names.py``), read from the scheduler on the engine thread: ``Engine.stats()``.
What does not change while it runs (its context, block size...) is ``Engine.limits()``."""

from __future__ import annotations

from pagedserve.worker.core.scheduler import Scheduler


def engine_stats(sched: Scheduler) -> dict[str, float]:
    usage = sched.blocks.usage()
    return {
        "num_requests_running": len(sched.running), "num_requests_waiting": len(sched.waiting),
        "num_requests_swapped": len(sched.swapped), "kv_cache_usage_perc": usage.used / max(1, usage.total),
        "num_preemptions_total": sched.stats.num_preemptions,
        "prefix_cache_queries_total": sched.stats.prefix_query_tokens,
        "prefix_cache_hits_total": sched.stats.prefix_hit_tokens, "cow_copies_total": sched.stats.cow_copies,
        "kv_blocks_saved_by_sharing": usage.logical - usage.used,
    }
