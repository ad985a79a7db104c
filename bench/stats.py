"""Latency summaries shared by the benchmarks."""

from __future__ import annotations

import statistics


def percentiles(values: list[float]) -> dict:
    """p50/p90/p99 of seconds, in milliseconds (None for an empty list)."""
    if not values:
        return {"p50_ms": None, "p90_ms": None, "p99_ms": None}
    q = statistics.quantiles(values, n=100) if len(values) > 1 else values * 99
    return {"p50_ms": round(q[49] * 1e3, 3), "p90_ms": round(q[89] * 1e3, 3), "p99_ms": round(q[98] * 1e3, 3)}
