"""What a step costs in time, from what it computes, fitted over the engine's own recent steps: a
fixed part, a part per token and a part per query-key pair attention computes (a row of ``n`` new
tokens from position ``s`` attends over ``n * s + n * (n + 1) / 2`` pairs: the last chunks of a long
prompt cost several times its first). Least squares over the recent steps, each older step weighing
``DECAY`` as much as the next: a ``DecayedFit``, as is the per-batch-size fit that prices
speculation (``worker/core/speculative/draft_cost.py``), there without the pairs.

The scheduler sizes prefill chunks by it under ``max_step_ms`` (``Scheduler``): a step that carries
decoding rows stays within the target, so a long prompt's prefill never pauses the streams for
longer than that; with no row decoding, chunks are as large as the token budget allows.

Pure Python, no torch.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from pagedserve.worker.core.decayed_fit import DecayedFit

DECAY = 0.98
MIN_STEPS = 8  # steps seen before the fit is used
FEATURES = 3  # 1, tokens, pairs
MIN_PREFILL = 16  # tokens a prefill chunk carries at least under max_step_ms
UNPRICED_PREFILL = 128  # ... and at most beside decoding rows while the step time is not priced (the fit learns from them)
REACH = 2  # ... and at most this many times the largest step seen lately: the fit is trusted that far from its data
REACH_DECAY = 0.9  # per step, how fast an old large step stops counting as seen lately (half in ~7 steps)
PREFILLING_AT_ONCE = 4  # once a step's prefill time is spent, a new prompt starts only beside fewer running ones:
#   a burst of 50 prompts each started with MIN_PREFILL tokens overran the target (0.5-0.7 s steps) and all
#   finished late, so their rows began decoding late (a W64 batch 6.6% slower, docs/benchmarks.md)


STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # seconds (StepSeconds)


def pairs(start: int, tokens: int) -> float:
    """Query-key pairs a row of ``tokens`` new tokens from position ``start`` attends over."""
    return tokens * start + tokens * (tokens + 1) / 2


@dataclass
class StepTime:
    seen: DecayedFit = field(default_factory=lambda: DecayedFit(FEATURES, DECAY))
    largest: float = 0.0  # the largest step's tokens seen lately (decayed by REACH_DECAY a step)

    def observe(self, tokens: int, attended: float, seconds: float) -> None:
        """A step: its tokens, their query-key pairs (``pairs`` summed over its rows) and its seconds."""
        self.seen.observe((1.0, float(tokens), float(attended)), seconds)
        self.largest = max(float(tokens), self.largest * REACH_DECAY)

    def trusted(self) -> int:
        """The most tokens a chunk beside decoding rows carries on the fit's word: ``REACH`` times the
        largest step seen lately (``UNPRICED_PREFILL`` at least). After a stretch of decoding alone,
        the fit knows steps of a few tokens; a first chunk of the whole budget priced from them missed
        its target by a quarter (docs/benchmarks.md): chunks grow from what was seen, each step's
        time teaching the fit the next size."""
        return max(UNPRICED_PREFILL, int(REACH * self.largest))

    def coefficients(self) -> tuple[float, float, float] | None:
        """(fixed seconds, seconds per token, seconds per pair), none negative; None while the steps
        seen are too few or too alike to tell the parts apart."""
        solved = self.seen.solve() if self.seen.weight >= MIN_STEPS else None
        return None if solved is None else tuple(max(part, 0.0) for part in solved)

    def seconds(self, tokens: int, attended: float) -> float | None:
        """A step's seconds (None while not priced)."""
        fit = self.coefficients()
        return None if fit is None else fit[0] + fit[1] * tokens + fit[2] * attended

    def chunk_seconds(self, start: int, tokens: int) -> float:
        """What a prefill chunk adds to a step (0 while not priced)."""
        fit = self.coefficients()
        return 0.0 if fit is None else fit[1] * tokens + fit[2] * pairs(start, tokens)

    def chunk(self, seconds_left: float, start: int, most: int) -> int:
        """The most tokens (up to ``most``) a prefill chunk from position ``start`` may carry within
        ``seconds_left`` of the step (0 when not even one fits)."""
        fit = self.coefficients()
        if fit is None:
            return most
        _, per_token, per_pair = fit
        cost = lambda n: per_token * n + per_pair * pairs(start, n)  # noqa: E731  (grows with n)
        if cost(most) <= seconds_left:
            return most
        low, high = 0, most  # cost(low) fits, cost(high) does not
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if cost(middle) <= seconds_left else (low, middle)
        return low


@dataclass
class StepSeconds:
    """Every step's seconds, counted into ``STEP_BUCKETS``: how long streams waited for a token, for
    ``/metrics`` (``pagedserve:engine_step_seconds``, a histogram) and the stats line (its p99)."""
    counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS) + 1))  # per bucket; the last: above them all
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(STEP_BUCKETS, seconds)] += 1
        self.total += seconds

    def snapshot(self, name: str = "engine_step_seconds") -> dict[str, float]:
        """Prometheus's cumulative form, as flat numbers: ``{name}_le_{bound}`` (steps that took at
        most ``bound`` seconds), ``{name}_count`` and ``{name}_sum``."""
        cumulative, below = {}, 0
        for bound, count in zip(STEP_BUCKETS, self.counts):
            below += count
            cumulative[f"{name}_le_{bound:g}"] = float(below)
        return {**cumulative, f"{name}_count": float(sum(self.counts)), f"{name}_sum": self.total}


@dataclass
class PrefillBudget:
    """One step's time for prefill chunks under ``max_step_ms``: what the target leaves beside the
    step's decoding rows (None: no limit, nobody decodes: a lone prompt goes as fast as the token
    budget allows), handed out chunk by chunk in the order the scheduler asks."""
    fit: StepTime
    seconds_left: float | None

    @classmethod
    def beside(cls, fit: StepTime, max_step_ms: float, decoding_starts: list[int]) -> PrefillBudget:
        """The budget of a step whose decoding rows are at these positions: what the target leaves
        beside them, and never less than the rows' own time. Where decoding alone nears the target
        (a large model, a large batch), prompts still get half of each step, so new requests are
        not starved; a stream's gap stays within the target or twice its plain step."""
        if not decoding_starts:
            return cls(fit, None)
        decoding = fit.seconds(len(decoding_starts), sum(pairs(start, 1) for start in decoding_starts)) or 0.0
        return cls(fit, max(max_step_ms / 1000 - decoding, decoding))

    @property
    def spent(self) -> bool:
        """Whether the time left could not take a new prompt's first ``MIN_PREFILL`` tokens (never where
        nobody decodes, nor while the fit does not price a step: ``cut`` takes no time then, and chunks
        carry ``UNPRICED_PREFILL`` tokens at most)."""
        return self.seconds_left is not None and self.seconds_left < self.fit.chunk_seconds(0, MIN_PREFILL)

    def cut(self, start: int, count: int, turns: int = 1) -> int:
        """A prefill chunk of ``count`` tokens from ``start``, cut to its part of the time left
        (``1 / turns``: the prompts still to ask share it; at least ``MIN_PREFILL`` tokens: a prompt
        always moves; ``UNPRICED_PREFILL`` at most until the fit prices a step, and no more than it
        trusts after that: ``StepTime.trusted``), its time taken from what is left."""
        if count <= 1 or self.seconds_left is None:
            return count
        if self.fit.coefficients() is None:
            return min(count, UNPRICED_PREFILL)
        most = min(count, self.fit.trusted())
        tokens = max(min(most, MIN_PREFILL), self.fit.chunk(self.seconds_left / turns, start, most))
        self.seconds_left -= self.fit.chunk_seconds(start, tokens)
        return tokens

