"""A least-squares fit over a stream of observations, each older one weighing ``decay`` as much as
the next: the engine's models of its own step times are each one of these over their own features
(what a step costs in time, for prefill chunks: ``step_time.StepTime``, over 1, tokens and the
query-key pairs attention computes; what a drafted token costs, per batch size:
``speculative/draft_cost.StepFit``, over 1 and tokens).

Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class DecayedFit:
    """The weighed sums of ``x xᵀ`` and ``x y`` over the observations seen, ``weight`` their count
    weighed alike; ``solve`` gives the coefficients, solved once per observation."""
    features: int
    decay: float = 0.98
    xtx: list[list[float]] = field(default_factory=list)
    xty: list[float] = field(default_factory=list)
    weight: float = 0.0
    _solved: list[float] | None = field(default=None, repr=False)  # solve(), until the next observation

    def __post_init__(self) -> None:
        self.xtx = self.xtx or [[0.0] * self.features for _ in range(self.features)]
        self.xty = self.xty or [0.0] * self.features

    def observe(self, x: Sequence[float], y: float) -> None:
        """One observation: its features ``x`` (the first is 1 for a fixed part) and its value."""
        n, d = self.features, self.decay
        self.xtx = [[d * self.xtx[i][j] + x[i] * x[j] for j in range(n)] for i in range(n)]
        self.xty = [d * self.xty[i] + x[i] * y for i in range(n)]
        self.weight = d * self.weight + 1
        self._solved = None

    def solve(self) -> list[float] | None:
        """The coefficients that fit the observations best, or None while they cannot tell the
        features apart (too few, or too alike)."""
        if self._solved is None:
            self._solved = _solve(self.xtx, self.xty)
        return self._solved


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
