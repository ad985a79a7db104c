"""The last minute of time-to-first-token and inter-token latencies, for the KV dashboard's charts
(Prometheus histograms hold buckets since start; a chart wants percentiles of the last seconds).
Bounded: samples older than ``keep_s`` are dropped as new ones come (not only when a chart asks:
with no dashboard open, the soak's gateway kept 20,000 of each kind), and at most ``max_samples``
of each kind are kept, the oldest dropped first."""

from __future__ import annotations

import time
from collections import deque


class RecentLatencies:
    def __init__(self, keep_s: float = 60.0, max_samples: int = 20_000) -> None:
        self.keep_s = keep_s
        self._samples: dict[str, deque[tuple[float, float]]] = {
            kind: deque(maxlen=max_samples) for kind in ("ttft", "itl")}

    def add(self, kind: str, seconds: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._forget(kind, now)  # here too: with no dashboard open, nothing else would
        self._samples[kind].append((now, seconds))

    def kept(self, kind: str) -> int:
        """How many samples of ``kind`` are held now."""
        return len(self._samples[kind])

    def _forget(self, kind: str, now: float) -> None:
        samples = self._samples[kind]
        while samples and samples[0][0] < now - self.keep_s:
            samples.popleft()

    def percentiles(self, kind: str, window_s: float = 10.0, now: float | None = None) -> dict[str, float | int]:
        """``{"count", "p50", "p90", "p99", "max"}`` in milliseconds over the last ``window_s`` (zeros when
        none): ``max`` is the longest one, a stall that a few samples among thousands hide from p99."""
        now = time.monotonic() if now is None else now
        self._forget(kind, now)
        samples = self._samples[kind]
        recent = sorted(v for t, v in samples if t >= now - window_s)
        if not recent:
            return {"count": 0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
        pick = lambda q: round(1000 * recent[min(len(recent) - 1, int(q * len(recent)))], 2)  # noqa: E731
        return {"count": len(recent), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": pick(1.0)}
