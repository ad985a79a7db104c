"""Speculative decoding's check leaves the target distribution unchanged: thousands of draws of a
two-token draft, seeded and unseeded, with temperature, top-k, top-p, min-p and every penalty, and
a chi-square test at each position against the sampler's own filtered softmax given the history
the position really has (the drafts before it count for the penalties)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.core.scheduling.plan import ScheduledSeq
from pagedserve.worker.runner.sampling.sampler import Sampler, SampleRow, apply_penalties, filtered_probs
from pagedserve.worker.runner.speculative.draft_check import check_drafts
from tests.runner.test_sampler_distribution import chi_square_critical

VOCAB, DRAWS, DRAFT = 48, 4000, 7
PROMPT, OUTPUT = (1, 2, 3), (4, 5, 6)
PARAMS = dict(temperature=0.9, top_k=30, top_p=0.95, min_p=0.02, repetition_penalty=1.8,
              presence_penalty=0.6, frequency_penalty=0.4)


def position_logits() -> torch.Tensor:
    """Logits before the first draft, before the second, after the last. The draft (7, 7) is
    likely at both drafted positions, so the penalty the first draft puts on the second moves real
    mass, and a check that forgot the history would be seen."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    logits[0, DRAFT] = 4.0
    logits[1, DRAFT] = 7.0
    return logits


def target(logits: torch.Tensor, params: SamplingParams, output: tuple[int, ...]) -> torch.Tensor:
    row = SampleRow(params, PROMPT, output, 0, 1, len(output))
    probs = filtered_probs(apply_penalties(logits[None].clone(), [row], ()), [params])[0]
    return probs / probs.sum()


def chi_square(tokens: list[int], expected: torch.Tensor) -> tuple[float, float]:
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=VOCAB).double()
    allowed = expected > 0
    assert counts[~allowed].sum() == 0, "a token outside the filtered set"
    wanted = expected[allowed] * len(tokens)
    return float(((counts[allowed] - wanted) ** 2 / wanted).sum()), chi_square_critical(int(allowed.sum()) - 1)


@pytest.mark.parametrize("seeded", [True, False])
def test_drafted_positions_draw_from_the_targets_filtered_softmax(seeded):
    logits = position_logits()
    sampler = Sampler(frozenset())
    runs = []
    for s in range(DRAWS):
        params = SamplingParams(seed=s if seeded else None, **PARAMS)
        item = ScheduledSeq(0, "r", (OUTPUT[-1], DRAFT, DRAFT), 6, (0,), 1, params, 0, len(OUTPUT), PROMPT, OUTPUT,
                            num_draft=2)
        runs.append([t.token_id for t in check_drafts(sampler, [item], [logits[:2]], logits[2:])[0]])
    params = SamplingParams(**PARAMS)
    first = [run[0] for run in runs]
    second = [run[1] for run in runs if len(run) > 1]
    third = [run[2] for run in runs if len(run) > 2]
    assert all(len(run) == 1 or run[0] == DRAFT for run in runs) and all(len(run) < 3 or run[1] == DRAFT for run in runs)
    assert len(second) > DRAWS / 3 and len(third) > DRAWS / 8  # drafts kept often enough to test what follows
    for tokens, expected in ((first, target(logits[0], params, OUTPUT)),
                             (second, target(logits[1], params, OUTPUT + (DRAFT,))),
                             (third, target(logits[2], params, OUTPUT + (DRAFT, DRAFT)))):
        statistic, critical = chi_square(tokens, expected)
        assert statistic < critical, (statistic, critical)


def test_a_seeded_row_draws_what_it_draws_one_step_at_a_time():
    """The drafts' check is the plain step's draw: same seed, same tokens, same logprobs."""
    logits = position_logits()
    sampler = Sampler(frozenset())
    for s in range(200):
        params = SamplingParams(seed=s, logprobs=3, **PARAMS)
        item = ScheduledSeq(0, "r", (OUTPUT[-1], DRAFT, DRAFT), 6, (0,), 1, params, 0, len(OUTPUT), PROMPT, OUTPUT,
                            num_draft=2)
        checked = check_drafts(sampler, [item], [logits[:2]], logits[2:])[0]
        history = OUTPUT
        for position, token in enumerate(checked):
            alone = sampler.sample(logits[position][None], [SampleRow(params, PROMPT, history, 0, 1, len(history))])[0][0]
            assert alone == token
            history += (token.token_id,)


def test_rows_checked_together_draw_what_each_draws_alone():
    """One sampler call for every drafting row of a step: seeded rows with drafts of different
    lengths get, together, the tokens each gets checked alone."""
    logits = position_logits()
    sampler = Sampler(frozenset())
    items, befores, lasts = [], [], []
    for s in range(12):
        num_draft = 1 + s % 2
        params = SamplingParams(seed=100 + s, logprobs=2, **PARAMS)
        items.append(ScheduledSeq(s, f"r{s}", (OUTPUT[-1],) + (DRAFT,) * num_draft, 6, (s,), 1, params, 0, len(OUTPUT),
                                  PROMPT, OUTPUT, num_draft=num_draft))
        befores.append(logits[:num_draft])
        lasts.append(logits[num_draft])
    together = check_drafts(sampler, items, befores, torch.stack(lasts))
    alone = [check_drafts(sampler, [item], [before], last[None])[0] for item, before, last in zip(items, befores, lasts)]
    assert together == alone and {len(run) for run in together} == {1, 2, 3}
