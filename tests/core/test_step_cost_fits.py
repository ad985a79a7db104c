"""The engine's step-cost fits part by part (``worker/core/decayed_fit.py`` under both
``scheduling/step_time.py`` and ``speculative/draft_cost.py``): what a chunk attends over, when a fit
is priced, what a step and a chunk cost, the time a step leaves for prefill, how a chunk is cut, the
singular systems the solver refuses, and speculation's per-round draft costs fading."""

from __future__ import annotations

import pytest

from pagedserve.worker.core.decayed_fit import _solve
from pagedserve.worker.core.scheduling.step_time import MIN_PREFILL, PrefillBudget, StepTime, pairs
from pagedserve.worker.core.speculative.draft_cost import StepCost, StepFit

PARTS = (0.01, 1e-4, 2e-8)  # seconds: fixed, per token, per query-key pair


def priced() -> StepTime:
    fit = StepTime()
    for tokens, attended in [(1, 10.0), (64, 5e4), (512, 2e5), (8, 3e6), (2048, 1e6), (3, 7e5), (900, 9e6), (17, 40.0),
                             (300, 1e5)]:
        fit.observe(tokens, attended, PARTS[0] + PARTS[1] * tokens + PARTS[2] * attended)
    return fit


def test_a_chunk_attends_over_its_context_and_itself():
    assert pairs(0, 1) == 1 and pairs(5, 1) == 6  # a decode row at position 5 reads 6 keys
    assert pairs(10, 4) == 4 * 10 + 1 + 2 + 3 + 4
    assert pairs(0, 2048) == 2048 * 2049 / 2


def test_a_step_and_a_chunk_cost_their_parts_once_priced():
    unpriced = StepTime()
    unpriced.observe(64, 1e4, 0.02)
    assert unpriced.coefficients() is None and unpriced.seconds(64, 1e4) is None
    assert unpriced.chunk_seconds(100, 64) == 0.0 and unpriced.chunk(0.001, 0, 500) == 500
    fit = priced()
    assert fit.coefficients() == pytest.approx(PARTS, rel=1e-6)
    assert fit.seconds(100, 3e5) == pytest.approx(PARTS[0] + PARTS[1] * 100 + PARTS[2] * 3e5, rel=1e-9)
    assert fit.chunk_seconds(4000, 100) == pytest.approx(PARTS[1] * 100 + PARTS[2] * pairs(4000, 100), rel=1e-9)
    exact = fit.chunk_seconds(4000, 300)  # a chunk whose cost is the time left to the last bit still fits
    assert fit.chunk(exact, 4000, 300) == 300 and fit.chunk(exact, 4000, 301) == 300


def test_eight_steps_weighed_as_they_fade_price_a_fit():
    fit = StepTime()
    sizes = [1, 64, 512, 8, 2048, 3, 900, 17, 300]
    for n, tokens in enumerate(sizes, 1):
        fit.observe(tokens, tokens * 100.0 + n * n, 0.01 + 1e-4 * tokens)
        assert (fit.coefficients() is not None) == (fit.seen.weight >= 8), n  # 0.98-decayed: the ninth step


def test_the_time_a_step_leaves_for_prefill_is_the_target_less_its_decoding_rows():
    fit = priced()
    assert PrefillBudget.beside(fit, 50, []).seconds_left is None  # nobody decodes: no limit
    budget = PrefillBudget.beside(fit, 50, [100, 2000, 31])
    assert budget.seconds_left == pytest.approx(0.05 - fit.seconds(3, pairs(100, 1) + pairs(2000, 1) + pairs(31, 1)), rel=1e-9)
    assert PrefillBudget.beside(StepTime(), 50, [100]).seconds_left == 0.05  # not priced: the whole target


def test_a_cut_takes_its_time_from_what_is_left_and_a_decode_row_takes_none():
    fit = priced()
    budget = PrefillBudget(fit, 0.03)
    assert budget.cut(500, 1) == 1 and budget.seconds_left == 0.03
    tokens = budget.cut(4000, 2000)
    assert 0 < tokens < 2000 and budget.seconds_left == pytest.approx(0.03 - fit.chunk_seconds(4000, tokens), abs=1e-12)
    assert budget.seconds_left >= 0
    left = budget.seconds_left
    assert budget.cut(7000, 2) == 2 and budget.seconds_left < left  # two tokens are a chunk: priced
    assert budget.cut(7000, 500) == MIN_PREFILL  # no time left: the least a prompt moves


def test_the_solver_refuses_a_system_singular_at_its_own_scale():
    assert _solve([[2.0, 1.0], [1.0, 3.0]], [5.0, 10.0]) == pytest.approx([1.0, 3.0])
    assert _solve([[1e8, 1e8], [1e8, 1e8 + 1e-5]], [1.0, 1.0]) is None  # 1e-13 of its size apart: singular
    assert _solve([[0.0, 0.0], [0.0, 0.0]], [0.0, 0.0]) is None


def test_speculations_fit_waits_for_steps_of_different_sizes_and_weighs_recent_draft_rounds_more():
    few = StepFit()
    for tokens in (1, 40, 7, 100, 3):
        few.observe(tokens, 0.01 + 0.001 * tokens)
    assert not few.priced()  # five steps: too few
    alike = StepFit()
    for n in range(30):
        alike.observe(100 + n % 2, 0.05 + 0.001 * (n % 2))  # 100 and 101 tokens: too alike to tell a token's cost
    assert not alike.priced()
    plain = StepFit()
    for _ in range(12):
        plain.observe(16, 0.05)  # one size, never drafted: no plain step needed
    assert not plain.wants_plain_step()
    rounds = StepFit()
    for tokens in [1, 4, 16, 64] * 3:
        rounds.observe(tokens, 0.030 + 0.002 * tokens + 0.001, drafted=True, draft_rounds=1, draft_seconds=0.001)
    for tokens in [1, 4, 16, 64] * 15:
        rounds.observe(tokens, 0.030 + 0.002 * tokens + 0.02, drafted=True, draft_rounds=1, draft_seconds=0.02)
    recent, early = sum(0.98 ** k for k in range(60)), sum(0.98 ** k for k in range(60, 72))
    per_round = (0.02 * recent + 0.001 * early) / (recent + early)  # the early 1 ms rounds have faded
    assert rounds.token_share(1) == pytest.approx((0.002 + per_round) / 0.032, rel=1e-6)
    cost = StepCost()
    for tokens in [1, 4, 16, 64] * 3:
        cost.observe(4, tokens, 0.03 + 0.002 * tokens + 0.01, drafted=True, draft_rounds=2, draft_seconds=0.01)
    assert cost.fit(4).drafted == pytest.approx(cost.fit(4).seen.weight) and cost.fit(4).draft == pytest.approx([sum(2 * 0.98 ** k for k in range(12)),
                                                                           sum(0.01 * 0.98 ** k for k in range(12))])
    assert cost.share(4) == (pytest.approx((0.002 * 4 + 0.005) / (0.03 + 0.002 * 4), rel=1e-9), False)
