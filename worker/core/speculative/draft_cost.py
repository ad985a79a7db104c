"""What a drafted token costs: the engine's own step times, fitted per batch size.

A drafted token is worth checking when its chance of being kept beats what checking it costs, as a
share of the step (``DraftPace.worth``). That share depends on the batch: one row's step reads the
weights and a few more tokens cost little; sixteen rows' step on a CPU computes, and every token
costs nearly what a generated one does. So each batch size (rows bucketed by powers of two: 1, 2,
3-4, 5-8, ...) has its own fit (``StepFit``), fed only by its own steps: a fit of one-row steps
never prices a sixteen-row step. Until a bucket of several rows is priced, its rows draft one token
at most and make no draft model's first pass (``blind``): enough to price the bucket, not enough to
lose a batch's steps to drafts nobody knows pay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.worker.core.decayed_fit import DecayedFit

COST_DECAY = 0.98  # a fit: each older step weighs this much as the next
MIN_COST_STEPS = 8  # steps seen before a fit is used


@dataclass
class StepFit:
    """One batch size's step time as a fixed part and a part per token, fitted over its recent
    steps (least squares, each older step weighing ``COST_DECAY`` as much as the next: a
    ``DecayedFit``, as the step time that sizes prefill chunks is), and a draft
    model's time per round (its forward over the step's drafting rows), averaged alike.
    ``token_share(rows)``: the part of a step of ``rows`` one-token rows that one more token each
    costs, per row the price of checking a drafted token (and drafting it) against what a kept one
    saves. 0 (draft freely) until the fit has seen 8 steps whose sizes differ by a tenth; near 1
    where the forward's cost grows with every token or a draft round costs nearly a step. While the
    recent steps are all of one size and drafted (every row drafting the same),
    ``wants_plain_step`` asks for a step without drafts."""
    seen: DecayedFit = field(default_factory=lambda: DecayedFit(2, COST_DECAY))  # over 1 and tokens
    draft: list[float] = field(default_factory=lambda: [0.0, 0.0])  # draft rounds, their seconds
    drafted: float = 0.0  # the steps that carried drafts, weighed as ``seen.weight``

    def observe(self, tokens: int, seconds: float, drafted: bool = False, draft_rounds: int = 0,
                draft_seconds: float = 0.0) -> None:
        """A step: its tokens and seconds, of which ``draft_seconds`` were a draft model's rounds."""
        self.seen.observe((1.0, tokens), seconds - draft_seconds)
        self.drafted = COST_DECAY * self.drafted + drafted
        if draft_rounds:
            rounds, spent = (v * COST_DECAY for v in self.draft)
            self.draft = [rounds + draft_rounds, spent + draft_seconds]

    def _fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None while the steps seen are too few or too alike."""
        w, x, xx = self.seen.weight, self.seen.xtx[0][1], self.seen.xtx[1][1]
        solved = self.seen.solve() if w >= MIN_COST_STEPS and w * xx - x * x > 0.01 * x * x else None
        return None if solved is None else (solved[0], max(solved[1], 0.0))

    def priced(self) -> bool:
        """Whether the steps seen tell what a token costs (8 or more, their sizes spread)."""
        return self._fit() is not None

    def wants_plain_step(self) -> bool:
        """Whether the recent steps all carried drafts and were all of one size: the fit cannot
        tell what a drafted token costs until a step without them is seen."""
        return self.seen.weight >= MIN_COST_STEPS and self.drafted > self.seen.weight / 2 and self._fit() is None

    def token_share(self, rows: int) -> float:
        fit, (rounds, spent) = self._fit(), self.draft
        if fit is None:
            return 0.0
        fixed, per_token = fit
        plain = max(fixed + per_token * rows, 1e-12)
        return min(1.0, (per_token * rows + (spent / rounds if rounds else 0.0)) / plain)


@dataclass
class StepCost:
    """A ``StepFit`` per batch size: rows 1, 2, 3-4, 5-8, ... (``bucket``), each fed its own steps."""
    fits: dict[int, StepFit] = field(default_factory=dict)

    @staticmethod
    def bucket(rows: int) -> int:
        return max(rows - 1, 0).bit_length()

    def fit(self, rows: int) -> StepFit:
        return self.fits.setdefault(self.bucket(rows), StepFit())

    def observe(self, rows: int, tokens: int, seconds: float, drafted: bool = False, draft_rounds: int = 0,
                draft_seconds: float = 0.0) -> None:
        """A step of ``rows`` rows (``StepFit.observe``)."""
        self.fit(rows).observe(tokens, seconds, drafted, draft_rounds, draft_seconds)

    def share(self, rows: int) -> tuple[float, bool]:
        """(token share, blind) for a step of ``rows`` rows: share 1 (draft nothing) when its fit
        asks for a plain step; blind when several rows run and their fit is not priced yet."""
        fit = self.fit(rows)
        if fit.wants_plain_step():
            return 1.0, False
        return fit.token_share(rows), rows > 1 and not fit.priced()
