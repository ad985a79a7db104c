"""A GGUF's Q4_K and Q6_K blocks multiplied with the input taken to int8 (``--gguf-activations int8``,
``csrc/gguf_x8.c``): exactly the dequantized weight times the input's int8 reading, where this CPU runs
it (AVX-512 BW and VNNI); the int16 kernel wherever it does not (other CPUs, Q8_0 blocks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.kernels.native_layer_ops import GGUF_KERNEL_TYPES
from pagedserve.worker.runner.cpu.gguf_linear import DecodeScratch, GgufEmbedding, GgufLinear, GgufMatrix
from tests.kernels.other_builds import built_for
from tests.kernels.test_gguf_linear import dequantized, matrix

pytest.importorskip("gguf")
X8_KINDS = ("Q4_K", "Q6_K")


@pytest.fixture
def x8_kernels(kernels):
    if not kernels.gguf_x8_runs(GGUF_KERNEL_TYPES["Q4_K"]):
        pytest.skip("no AVX-512 VNNI here: int8 inputs take the int16 kernel")
    return kernels


def int8_reading(x: torch.Tensor) -> torch.Tensor:
    """What the kernel multiplies: each group of 256 inputs at its largest / 127, rounded to nearest
    even, in float32 steps as the C code takes them."""
    groups = x.float().reshape(x.shape[0], -1, 256)
    top = groups.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(top > 0, top / 127, torch.ones_like(top))
    codes = torch.round(groups * (1 / scale)).clamp(-127, 127)
    return (codes.double() * scale.double()).reshape(x.shape)


def float_bound(xq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 rounding of a super-block's factor and of the sums across super-blocks."""
    return 1e-5 * (xq.abs() @ weight.abs().T) + 1e-6


@pytest.mark.parametrize("kind", X8_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17])
def test_the_product_is_the_dequantized_weight_times_the_inputs_int8_reading(x8_kernels, kind, dtype, rows):
    part = matrix(kind, 70, 768, seed=rows)
    weight = dequantized(kind, part.blocks.numpy()).double()
    bias = torch.randn(70).to(dtype)
    layer = GgufLinear([part], x8_kernels, DecodeScratch({}), bias, int8_inputs=True)
    x = (torch.randn(rows, 768) * torch.logspace(-2, 1, 768)).to(dtype)  # groups spanning three decades
    xq = int8_reading(x)
    got = layer(x).double()
    want = xq @ weight.T + bias.double()
    bound = float_bound(xq, weight) + (want.abs() * 2**-8 if dtype == torch.bfloat16 else 0)  # the output's rounding
    assert ((got - want).abs() <= bound).all(), ((got - want).abs() / bound).max()
    int16 = GgufLinear([part], x8_kernels, DecodeScratch({}), bias)(x).double()
    assert not torch.equal(got, int16)  # the int8 reading, not the int16 one


@pytest.mark.parametrize("kind", X8_KINDS)
def test_with_int8_inputs_a_row_gives_the_same_bits_alone_and_in_any_batch(x8_kernels, kind):
    layer = GgufLinear([matrix(kind, 48, 512)], x8_kernels, DecodeScratch({}), int8_inputs=True)
    x = torch.randn(37, 512)
    batch = layer(x)
    for r in (0, 16, 36):
        assert torch.equal(layer(x[r:r + 1]), batch[r:r + 1])
    for rows in (2, 3, 4, 17):
        assert torch.equal(layer(x[:rows]), batch[:rows])


def test_the_largest_codes_scales_and_inputs_do_not_overflow_the_integer_sums(x8_kernels):
    """Q4_K: every code 15 at scale 63 and minimum 63; Q6_K: codes 0 and 63 at scale -128; inputs all
    +-127 once read: the int16 pair sums (2 x 63 x 127) and the int32 lanes stay exact."""
    q4 = np.zeros((2, 144), dtype=np.uint8)
    q4[:, 0:4] = np.array([1.0, 0.5], dtype=np.float16).view(np.uint8)  # d, dmin
    q4[:, 4:16] = 0xFF  # every 6-bit scale and minimum 63
    q4[:, 16:] = 0xFF  # every code 15
    q6 = np.zeros((4, 210), dtype=np.uint8)
    q6[2:, :192] = 0xFF
    q6[:, 192:208] = 0x80
    q6[:, 208:210] = np.array([1.0], dtype=np.float16).view(np.uint8)[None]
    x = torch.tensor([1.0, -1.0, 1.0])[:, None].repeat(1, 256)
    for kind, raw in (("Q4_K", q4), ("Q6_K", q6)):
        weight = dequantized(kind, raw).double()
        layer = GgufLinear([GgufMatrix(GGUF_KERNEL_TYPES[kind], torch.from_numpy(raw), 256)], x8_kernels,
                           DecodeScratch({}), int8_inputs=True)
        for rows in (x[:1], x):
            assert torch.allclose(layer(rows).double(), rows.double() @ weight.T, rtol=1e-6), kind


def test_q8_0_blocks_and_cpus_without_the_kernel_take_the_int16_kernel(kernels, tmp_path):
    part = matrix("Q8_0", 40, 512)
    x = torch.randn(3, 512)
    assert torch.equal(GgufLinear([part], kernels, DecodeScratch({}), int8_inputs=True)(x),
                       GgufLinear([part], kernels, DecodeScratch({}))(x))
    haswell = built_for("haswell", ("gguf_linear.c", "gguf_x8.c"), ("gguf_linear", "gguf_linear_x8"), tmp_path)
    assert not haswell.gguf_x8_runs(GGUF_KERNEL_TYPES["Q4_K"])
    q4 = matrix("Q4_K", 40, 512)
    assert torch.equal(GgufLinear([q4], haswell, DecodeScratch({}), int8_inputs=True)(x),
                       GgufLinear([q4], haswell, DecodeScratch({}))(x))


def test_the_choice_reaches_fused_layers_a_tied_head_and_the_c_stack(x8_kernels):
    from pagedserve.worker.runner.cpu.native_stack import _matrix

    q, v = matrix("Q4_K", 64, 512, 1), matrix("Q6_K", 32, 512, 2)
    fused = GgufLinear([q], x8_kernels, DecodeScratch({}), int8_inputs=True).stacked_with(
        [GgufLinear([v], x8_kernels, DecodeScratch({}), int8_inputs=True)])
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(0))
    weight = torch.cat([dequantized(kind, p.blocks.numpy()).double() for kind, p in (("Q4_K", q), ("Q6_K", v))])
    xq = int8_reading(x)
    assert fused.int8_inputs and ((fused(x).double() - xq @ weight.T).abs() <= float_bound(xq, weight)).all()
    stack = _matrix(fused, x8_kernels, torch.float32)
    assert torch.equal(stack(x, torch.empty(2, 96)), fused(x))
    head = GgufEmbedding(q, x8_kernels, DecodeScratch({}), torch.float32, int8_inputs=True).as_linear()
    assert head.int8_inputs


def test_an_unknown_input_precision_is_refused_at_once():
    from pagedserve.worker.setup.engine_config import EngineConfig

    with pytest.raises(ValueError, match="gguf_activations must be one of int16, int8, got 'int4'"):
        EngineConfig(model="demo", gguf_activations="int4")
