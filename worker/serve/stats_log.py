"""The worker's periodic stats line (``--log-stats-interval``): throughput since the last line,
the batch, KV usage and prefix-cache hit rate, so an operator reading logs sees load without a
Prometheus server, and the steps' p99 (how long a stream may wait for a token: a long prompt's
prefill shows here). Quiet while nothing happens."""

from __future__ import annotations

import time

from pagedserve.runtime.metric_names import bucket_keys


class StatsLine:
    def __init__(self, interval_s: float, clock=time.monotonic) -> None:
        self.interval_s, self.clock = interval_s, clock
        self._at = clock()
        self._last: dict[str, float] = {}

    def due(self, metrics: dict[str, float]) -> dict | None:
        """The line's fields when the interval has passed and something ran or changed, else None."""
        now = self.clock()
        if self.interval_s <= 0 or now - self._at < self.interval_s:
            return None
        elapsed, before = now - self._at, self._last
        self._at, self._last = now, dict(metrics)

        def rate(key: str) -> float:
            return round((metrics.get(key, 0.0) - before.get(key, 0.0)) / elapsed, 1)

        queried = metrics.get("prefix_cache_queries_total", 0.0) - before.get("prefix_cache_queries_total", 0.0)
        hits = metrics.get("prefix_cache_hits_total", 0.0) - before.get("prefix_cache_hits_total", 0.0)
        fields = {
            "prompt_tok_s": rate("prefix_cache_queries_total"), "generation_tok_s": rate("generation_tokens_total"),
            "running": int(metrics.get("num_requests_running", 0)), "waiting": int(metrics.get("num_requests_waiting", 0)),
            "kv_usage_pct": round(100 * metrics.get("kv_cache_usage_perc", 0.0), 1),
            "prefix_hit_pct": round(100 * hits / queried, 1) if queried else 0.0,
            "preemptions": int(metrics.get("num_preemptions_total", 0) - before.get("num_preemptions_total", 0)),
            "step_ms_p99": step_p99_ms(metrics, before),
        }
        idle = not (fields["prompt_tok_s"] or fields["generation_tok_s"] or fields["running"] or fields["waiting"])
        return None if idle else fields


def step_p99_ms(metrics: dict[str, float], before: dict[str, float], stem: str = "engine_step_seconds") -> float | None:
    """The bound of the step-time bucket the 99th percentile of the steps since the last line fell
    in, in ms (None: no step; above every bound: the largest bound)."""
    steps = metrics.get(stem + "_count", 0.0) - before.get(stem + "_count", 0.0)
    if steps <= 0:
        return None
    bounds = bucket_keys(metrics, stem)
    for bound, key in bounds:
        if metrics[key] - before.get(key, 0.0) >= 0.99 * steps:
            return round(bound * 1000, 1)
    return round(bounds[-1][0] * 1000, 1) if bounds else None
