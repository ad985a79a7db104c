"""Quantized weights on real weights (SmolLM2-135M-Instruct, float32 activations unless the format
quantizes them): the text of ``tests/engine/test_kv_quality.py`` teacher-forced, each position's
logprob of its own token and the perplexity against the same file's weights dequantized to float32
(``quantization="none"``). The full measure is ``bench/weight_quality.py``."""

from __future__ import annotations

import math

import pytest

from tests.engine.test_kv_quality import POSITIONS, logprobs

# name -> (bound on the mean |logprob change|, bound on the perplexity change), against what they measured
# (2026-12-07, AVX-512 VNNI): int8 (a scale per output channel, int8 activations) 0.119 and +0.81%; int4 (a scale
# and zero per 32 inputs, float activations) 0.072 and +1.95%. "as stored" is the GGUF's own blocks run by the
# GGUF kernel: the same numbers as dequantized, to the bit (measured 0.0 and 0.0).
BOUNDS = {"int8": (0.16, 0.016), "int4": (0.09, 0.03), "gguf": (1e-4, 1e-5)}


def perplexity(values: list[float]) -> float:
    return math.exp(-sum(values) / len(values))


@pytest.fixture(scope="module")
def dequantized(real_model) -> list[float]:
    return logprobs(real_model, quantization="none")


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_quantized_weights_move_each_tokens_logprob_and_the_perplexity_little(real_model, dequantized, name):
    ours = logprobs(real_model, quantization=name)
    assert len(ours) == len(dequantized) == POSITIONS
    moved = sum(abs(a - b) for a, b in zip(dequantized, ours)) / POSITIONS
    change = perplexity(ours) / perplexity(dequantized) - 1
    bound_moved, bound_change = BOUNDS[name]
    assert moved < bound_moved and abs(change) < bound_change, f"{name}: moved {moved:.4f}, perplexity {change:+.4%}"
