"""Weight-only int8/int4 linear layers (``worker/runner/cpu/quantized_linear.py``): each multiplies by
the grid it stores (checked against that grid dequantized, from the same bf16 inputs), the grid is
within half a step of the weight, a weight already on a Q4_1-like grid comes back exactly, and the
engine with quantized weights batched equals the same engine serving one request at a time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedserve import LLM
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.runner.cpu.quantized_linear import (
    GROUP,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    dequantized_int4,
    quantize_linears,
)
from tests.conftest import random_prompts
from tests.engine.test_parity import run_checked


def linear(inputs: int, outputs: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(inputs, outputs, bias=bias)
    layer.weight.data *= torch.logspace(-1, 1, outputs)[:, None]  # rows of very different ranges
    return layer


def through_grid(x: torch.Tensor, grid: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.bfloat16().float() @ grid.T  # the layer's input is rounded to bf16 first
    return out + bias if bias is not None else out


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int8_multiplies_by_its_grid_within_half_a_step_of_the_weight(rows):
    plain = linear(96, 80)
    layer = Int8Linear(plain)
    grid = layer.dequantized()
    step = plain.weight.abs().amax(dim=1, keepdim=True) / 127
    assert bool(((grid - plain.weight).abs() <= step * 0.51).all())
    x = torch.randn(rows, 96)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 80)
    torch.testing.assert_close(out, through_grid(x, grid, plain.bias), atol=1e-2, rtol=8e-3)  # a bf16 output


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int4_multiplies_by_its_grid_within_half_a_step_of_the_weight(rows):
    plain = linear(4 * GROUP, 48, bias=False)
    layer = Int4Linear(plain)
    grid = dequantized_int4(layer)
    groups = plain.weight.reshape(48, -1, GROUP)
    step = ((groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15).expand_as(groups).reshape(48, -1)
    assert bool(((grid - plain.weight).abs() <= step * 0.51 + 1e-3).all())
    x = torch.randn(rows, 4 * GROUP)
    torch.testing.assert_close(layer(x), through_grid(x, grid, None), atol=1e-2, rtol=8e-3)
    x3 = torch.randn(2, 3, 4 * GROUP)
    assert layer(x3).shape == (2, 3, 48)


def test_a_weight_on_a_q4_1_grid_comes_back_exactly():
    """What a Q4_1 GGUF block holds (scale d, minimum m, codes 0..15 using both ends), with d and
    m exact in bf16: the int4 layer stores that grid itself."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (16, 2 * GROUP), generator=gen).float()
    codes[:, ::GROUP], codes[:, 1::GROUP] = 0, 15  # every group spans the whole code range
    d = (torch.rand(16, 2, 1, generator=gen) + 0.5).bfloat16().float() / 64
    m = -8 * d  # zero = m + 8 d = 0: exact in bf16
    weight = (codes.reshape(16, 2, GROUP) * d + m).reshape(16, 2 * GROUP)
    plain = nn.Linear(2 * GROUP, 16, bias=False)
    plain.weight.data = weight
    assert torch.equal(dequantized_int4(Int4Linear(plain)), weight)


def test_which_layers_are_replaced():
    model = nn.Module()
    model.body = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 48))
    model.odd = nn.Linear(40, 64)  # 40 inputs: not whole groups of 32
    model.narrow = nn.Linear(64, 40)  # 40 outputs: not whole tiles of 16
    model.lm_head = nn.Linear(64, 100, bias=False)  # int8 under int4, and any width
    assert quantize_linears(model, "int4", torch.device("cpu")) == 3
    assert [type(m) for m in (*model.body, model.odd, model.narrow, model.lm_head)] == [
        Int4Linear, Int4Linear, nn.Linear, nn.Linear, Int8Linear]
    assert quantize_linears(model, "none", torch.device("cpu")) == 0


def test_embeddings_are_int8_groups_and_a_tied_head_gets_its_own_codes():
    model = nn.Module()
    model.embed = nn.Embedding(100, 64)
    model.lm_head = nn.Linear(64, 100, bias=False)
    model.lm_head.weight = model.embed.weight  # tied
    model.other = nn.Embedding(10, 64)
    weight, other = model.embed.weight.detach().clone(), model.other.weight.detach().clone()
    assert quantize_linears(model, "int4", torch.device("cpu")) == 3  # the head and both tables
    assert isinstance(model.embed, Int8Embedding) and isinstance(model.lm_head, Int8Linear)
    ids = torch.tensor([[3, 99], [0, 42]])
    rows = model.embed(ids)
    assert rows.dtype == torch.float32 and rows.shape == (2, 2, 64)
    step = weight.reshape(100, 2, GROUP).abs().amax(dim=-1, keepdim=True).expand(100, 2, GROUP).reshape(100, 64) / 127
    assert bool(((rows - weight[ids]).abs() <= step[ids] * 0.51).all())
    assert isinstance(model.other, Int8Embedding)
    torch.testing.assert_close(model.other(torch.tensor([7])), other[[7]], atol=float(other.abs().max()) / 200, rtol=0)
    with pytest.raises(ValueError, match="quantization must be one of auto, none, int8, int4, gguf"):
        quantize_linears(model, "int3", torch.device("cpu"))
    with pytest.raises(ValueError, match="runs on the CPU so far"):
        quantize_linears(nn.Sequential(nn.Linear(64, 64)), "int8", torch.device("cuda"))


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_batched_and_preempted_equals_one_at_a_time(zoo, quantization):
    """Quantized weights are lossy by design; the engine must add nothing: batched, chunked,
    preempted and with prefix hits, every request gets the tokens it gets alone."""
    cases = random_prompts(seed=5, count=8, max_len=80, vocab=512, max_new=24)
    options = dict(device="cpu", dtype="float32", quantization=quantization, block_size=8)
    alone_llm = LLM(zoo.path("llama-gqa"), num_gpu_blocks=256, enable_prefix_caching=False, **options)
    alone = [alone_llm.generate([p], SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False)[0].outputs[0].token_ids
             for p, n in cases]
    llm = LLM(zoo.path("llama-gqa"), num_gpu_blocks=24, max_num_batched_tokens=48, **options)
    outs = run_checked(llm, [p for p, _ in cases], [SamplingParams(temperature=0.0, max_tokens=n) for _, n in cases])
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert [outs[i].outputs[0].token_ids for i in range(len(cases))] == alone
    layers = [type(m) for m in llm.engine.runner.model.modules()]
    assert (Int8Linear if quantization == "int8" else Int4Linear) in layers
    # int8 layers run the C kernel here (csrc/int8_linear.c), the head under int4 too
    assert all(m.kernels is not None for m in llm.engine.runner.model.modules() if isinstance(m, Int8Linear))
