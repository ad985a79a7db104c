"""The calibrated turns of q and k for a quantized KV cache (worker/runner/attention/key_rotation.py): exact for
every score, smaller score errors under rounding than the fixed turn where queries and keys lean
on different channels, and the same for every engine of one model whatever its pool or budget."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM
from pagedserve.kernels.kv_format import kv_format
from pagedserve.worker.runner.attention.key_rotation import RotationStats, calibrate, calibration_text

HEADS, KV_HEADS, DIM = 4, 2, 32


def stats_of(q: torch.Tensor, k: torch.Tensor) -> RotationStats:
    stats = RotationStats(KV_HEADS, DIM, torch.device("cpu"))
    stats.add(q, k)
    return stats


def sample(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys large in the first channels, queries in the last ones (as keys' rotary pairs and the
    queries that read them often are): the case a fixed turn handles worst."""
    channels = torch.arange(DIM, dtype=torch.float32)
    k_scale = torch.exp(-channels / 6)  # 1 down to ~0.006
    q_scale = torch.exp((channels - DIM) / 6)  # ~0.005 up to 1
    q = torch.randn(4096, HEADS, DIM, generator=generator) * q_scale
    k = torch.randn(4096, KV_HEADS, DIM, generator=generator) * k_scale
    return q, k


def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Each query head against every key of its group's KV head: [HEADS, Tq, Tk]."""
    group = HEADS // KV_HEADS
    return torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(group, dim=1))


def test_the_turns_keep_every_score():
    generator = torch.Generator().manual_seed(0)
    q, k = sample(generator)
    turns = stats_of(q, k).turns(kv_format("int8").rotation(DIM))
    q_rotated, k_rotated = turns.apply(q[:64], k[:64])
    torch.testing.assert_close(scores(q_rotated, k_rotated), scores(q[:64], k[:64]), rtol=1e-4, atol=1e-5)
    for head in range(KV_HEADS):
        torch.testing.assert_close(turns.q[head] @ turns.k[head].T, torch.eye(DIM), rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_calibrated_turns_move_the_scores_less_than_the_fixed_one(name):
    """Scores over keys stored through the cache's codes, against exact scores: the calibrated turns'
    error is well under the fixed turn's (red if the formula used the moments the wrong way round)."""
    generator = torch.Generator().manual_seed(1)
    fmt = kv_format(name)
    rotation = fmt.rotation(DIM)
    q, k = sample(generator)
    turns = stats_of(q, k).turns(rotation)
    q_test, k_test = sample(generator)
    q_test, k_test = q_test[:256], k_test[:256]
    exact = scores(q_test, k_test)

    def error(q_rotated: torch.Tensor, k_rotated: torch.Tensor) -> float:
        stored = fmt.dequantize(fmt.quantize(k_rotated))
        return (scores(q_rotated, stored) - exact).pow(2).mean().sqrt().item()

    fixed = error(q_test @ rotation, k_test @ rotation)
    calibrated = error(*turns.apply(q_test, k_test))
    assert calibrated < 0.5 * fixed, f"{name}: calibrated {calibrated:.3g} against fixed {fixed:.3g}"


def test_no_rows_is_a_clear_error():
    with pytest.raises(ValueError, match="no rows observed"):
        RotationStats(KV_HEADS, DIM, torch.device("cpu")).turns(torch.eye(DIM))


def rotations_of(llm: LLM) -> list[torch.Tensor]:
    return [layer.self_attn.attn.key_rotation.k for layer in llm.engine.runner.model.model.layers]


def test_engines_of_one_model_turn_alike_whatever_their_pool_and_budget(zoo):
    """The calibration runs in a runner of its own, a fixed chunk at a time: a small pool and a small
    token budget give the same turns as large ones (so the same tokens give the same blocks)."""
    small = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", kv_cache_dtype="int8", block_size=7,
                num_gpu_blocks=12, max_num_batched_tokens=32)
    large = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", kv_cache_dtype="int8", num_gpu_blocks=512)
    for a, b in zip(rotations_of(small), rotations_of(large), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    auto = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=64)
    assert all(layer.self_attn.attn.key_rotation is None for layer in auto.engine.runner.model.model.layers)


def test_calibration_names_the_device_of_every_tensor(zoo):
    """Run again under a meta default device: a tensor made without its device would land there."""
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", kv_cache_dtype="int8", num_gpu_blocks=64)
    before = rotations_of(llm)
    ids = llm.tokenizer.encode(calibration_text(), add_special_tokens=False)[:200]
    torch.set_default_device("meta")
    try:
        calibrate(llm.engine.runner, ids)
    finally:
        torch.set_default_device(None)
    after = rotations_of(llm)
    assert all(t.device.type == "cpu" for t in after)
    assert not torch.equal(before[0], after[0])  # fitted anew, on 200 tokens instead of the whole text
