"""The sampler draws from the distribution transformers' warpers define: temperature, top-k, top-p
over the renormalised top-k, min-p. 4,000 seeded first tokens per parameter set, a chi-square test
against the warpers' filtered softmax, and no token outside the set they allow."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.runner.sampling.sampler import SampleRow, Sampler

VOCAB, DRAWS = 64, 4000
CASES = [  # temperature, top_k, top_p, min_p; the first is Qwen's own generation default
    (0.7, 20, 0.8, 0.0),
    (1.0, 0, 0.9, 0.05),
    (1.3, 5, 1.0, 0.0),
    (1.0, 40, 0.6, 0.1),
]


def reference_probs(logits: torch.Tensor, temperature, top_k, top_p, min_p) -> torch.Tensor:
    scores = logits[None].clone()
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p:
        warpers.append(MinPLogitsWarper(min_p))
    for warp in warpers:
        scores = warp(None, scores)
    return torch.softmax(scores, dim=-1)[0]


def chi_square_critical(df: int, z: float = 3.72) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at p = 1e-4 (z = 3.72)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", CASES)
def test_seeded_draws_follow_the_transformers_warpers(temperature, top_k, top_p, min_p):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(11))  # flat enough that top-k drops real mass
    expected = reference_probs(logits, temperature, top_k, top_p, min_p)
    rows = [SampleRow(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=s),
                      (), (), 0, 1, 0) for s in range(DRAWS)]
    drawn = Sampler(frozenset()).sample(logits.expand(DRAWS, VOCAB), rows)
    counts = torch.bincount(torch.tensor([r[0].token_id for r in drawn]), minlength=VOCAB).double()
    allowed = expected > 0
    assert counts[~allowed].sum() == 0, f"drew {sorted(torch.nonzero(counts * ~allowed).flatten().tolist())}, outside the allowed set"
    wanted = expected[allowed] * DRAWS
    statistic = float(((counts[allowed] - wanted) ** 2 / wanted).sum())
    assert statistic < chi_square_critical(int(allowed.sum()) - 1), statistic
