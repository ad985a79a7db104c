"""The engine's numbers as the serve layer reports them (vLLM's metric names,
``runtime/metric_names.py``), read from the scheduler on the engine thread: ``Engine.stats()``.
What does not change while it runs (its context, block size...) is ``Engine.limits()``."""

from __future__ import annotations

from pagedserve.worker.core.scheduling.scheduler import Scheduler


def engine_stats(sched: Scheduler) -> dict[str, float]:
    usage = sched.blocks.usage()
    return {
        "num_requests_running": len(sched.running), "num_requests_waiting": len(sched.waiting),
        "num_requests_swapped": len(sched.swapped), "kv_cache_usage_perc": usage.used / max(1, usage.total),
        "num_preemptions_total": sched.stats.num_preemptions,
        "prefix_cache_queries_total": sched.stats.prefix_query_tokens,
        "prefix_cache_hits_total": sched.stats.prefix_hit_tokens, "cow_copies_total": sched.stats.cow_copies,
        "kv_blocks_saved_by_sharing": usage.logical - usage.used,
        **tier_stats(sched), **spec_stats(sched), **sched.stats.step_seconds.snapshot(),
    }


def spec_stats(sched: Scheduler) -> dict[str, float]:
    """Speculative decoding's counters (vLLM's ``spec_decode_*``), when it is on."""
    if sched.config.speculative is None:
        return {}
    spec = sched.applier.spec_stats
    return {"spec_decode_num_drafts_total": spec.drafts, "spec_decode_num_draft_tokens_total": spec.draft_tokens,
            "spec_decode_num_accepted_tokens_total": spec.accepted_tokens}


def tier_stats(sched: Scheduler) -> dict[str, float]:
    """The host and disk tiers under the prefix cache (``worker/core/kv_cache/tiers.py``), when there are any."""
    tiers = sched.blocks.tiers
    if tiers is None:
        return {}
    stats = {"kv_tier_hit_tokens_total": sched.stats.tier_hit_tokens, "kv_tier_demotions_total": tiers.stats.demotions,
             "kv_tier_spills_total": tiers.stats.spills, "kv_tier_host_hits_total": tiers.stats.host_hits,
             "kv_tier_disk_hits_total": tiers.stats.disk_hits}
    if tiers.host is not None:
        stats["kv_tier_host_blocks"] = len(tiers.host)
    if tiers.disk is not None:
        disk = tiers.disk.stats
        stats.update({"kv_tier_disk_bytes": tiers.disk.num_bytes, "kv_tier_disk_corrupt_total": disk.corrupt,
                      "kv_tier_disk_skipped_total": disk.skipped, "kv_tier_disk_read_seconds_total": disk.read_seconds})
    return stats
