"""What a step costs in time, from what it computes, fitted over the engine's own recent steps: a
fixed part, a part per token and a part per query-key pair attention computes (a row of ``n`` new
tokens from position ``s`` attends over ``n * s + n * (n + 1) / 2`` pairs: the last chunks of a long
prompt cost several times its first). Least squares over the recent steps, each older step weighing
``DECAY`` as much as the next (the per-batch-size fit that prices speculation,
``worker/core/speculative/draft_cost.py``, is the same kind of fit without the pairs).

The scheduler sizes prefill chunks by it under ``max_step_ms`` (``Scheduler``): a step that carries
decoding rows stays within the target, so a long prompt's prefill never pauses the streams for
longer than that; with no row decoding, chunks are as large as the token budget allows.

Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.98
MIN_STEPS = 8  # steps seen before the fit is used
FEATURES = 3  # 1, tokens, pairs
MIN_PREFILL = 16  # tokens a prefill chunk carries at least under max_step_ms
UNPRICED_PREFILL = 128  # ... and at most beside decoding rows while the step time is not priced (the fit learns from them)


def pairs(start: int, tokens: int) -> float:
    """Query-key pairs a row of ``tokens`` new tokens from position ``start`` attends over."""
    return tokens * start + tokens * (tokens + 1) / 2


@dataclass
class StepTime:
    xtx: list[list[float]] = field(default_factory=lambda: [[0.0] * FEATURES for _ in range(FEATURES)])
    xty: list[float] = field(default_factory=lambda: [0.0] * FEATURES)
    steps: float = 0.0  # weighed as the sums are
    _solved: tuple[float, float, float] | None = field(default=None, repr=False)  # coefficients(), until the next step

    def observe(self, tokens: int, attended: float, seconds: float) -> None:
        """A step: its tokens, their query-key pairs (``pairs`` summed over its rows) and its seconds."""
        x = (1.0, float(tokens), float(attended))
        self.xtx = [[DECAY * self.xtx[i][j] + x[i] * x[j] for j in range(FEATURES)] for i in range(FEATURES)]
        self.xty = [DECAY * self.xty[i] + x[i] * seconds for i in range(FEATURES)]
        self.steps = DECAY * self.steps + 1
        self._solved = None

    def coefficients(self) -> tuple[float, float, float] | None:
        """(fixed seconds, seconds per token, seconds per pair), none negative; None while the steps
        seen are too few or too alike to tell the parts apart. Solved once a step seen."""
        if self._solved is None and self.steps >= MIN_STEPS:
            solved = _solve(self.xtx, self.xty)
            if solved is not None:
                self._solved = tuple(max(part, 0.0) for part in solved)
        return self._solved

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
class PrefillBudget:
    """One step's time for prefill chunks under ``max_step_ms``: what the target leaves beside the
    step's decoding rows (None: no limit, nobody decodes: a lone prompt goes as fast as the token
    budget allows), handed out chunk by chunk in the order the scheduler asks."""
    fit: StepTime
    seconds_left: float | None

    @classmethod
    def beside(cls, fit: StepTime, max_step_ms: float, decoding_starts: list[int]) -> PrefillBudget:
        """The budget of a step whose decoding rows are at these positions."""
        if not decoding_starts:
            return cls(fit, None)
        decoding = fit.seconds(len(decoding_starts), sum(pairs(start, 1) for start in decoding_starts))
        return cls(fit, max_step_ms / 1000 - (decoding or 0.0))

    def cut(self, start: int, count: int) -> int:
        """A prefill chunk of ``count`` tokens from ``start``, cut to the time left (at least
        ``MIN_PREFILL`` tokens: a prompt always moves; ``UNPRICED_PREFILL`` at most until the fit
        prices a step), its time taken from what is left."""
        if count <= 1 or self.seconds_left is None:
            return count
        if self.fit.coefficients() is None:
            return min(count, UNPRICED_PREFILL)
        tokens = max(min(count, MIN_PREFILL), self.fit.chunk(self.seconds_left, start, count))
        self.seconds_left -= self.fit.chunk_seconds(start, tokens)
        return tokens


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` by Gaussian elimination with partial pivoting; None when ``a`` is (nearly) singular."""
    n = len(b)
    rows = [list(a[i]) + [b[i]] for i in range(n)]
    scale = max(abs(v) for row in a for v in row) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) <= 1e-12 * scale:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, n):
            factor = rows[r][col] / rows[col][col]
            rows[r] = [v - factor * p for v, p in zip(rows[r], rows[col])]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        x[i] = (rows[i][n] - sum(rows[i][j] * x[j] for j in range(i + 1, n))) / rows[i][i]
    return x
