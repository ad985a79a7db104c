"""The C layer kernels (``paged_kernels/csrc/layer_ops.c``) against the torch code of the layers they
replace: the rotary bit for bit (each product and sum rounded as torch rounds them), the norm and
SiLU to an ulp or two (only the order of a sum and the e^x differ); what the kernels refuse is left
untouched for the torch code. Skipped where no C compiler can build them."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from pagedserve.kernels import reference
from pagedserve.kernels.native_layer_ops import NativeLayerOps
from pagedserve.worker.runner.models.layers import RMSNorm
from pagedserve.worker.runner.models.rope import RotaryEmbedding
from tests.kernels.other_builds import built_for

DTYPES = [torch.float32, torch.bfloat16]


def _ulps(dtype: torch.dtype) -> float:
    return 2 * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_rms_norm_is_the_layers_norm(kernels, dtype, rows):
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = (torch.randn(576) * 0.3 + 1).to(dtype)
    norm.to(dtype)
    x = (torch.randn(rows, 576) * 4).to(dtype)
    expected = norm(x)
    got = kernels.rms_norm(x, norm.weight, norm.eps)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), expected.float(), rtol=2 * _ulps(dtype), atol=0)


def test_rms_norm_reads_rows_of_a_wider_tensor(kernels):
    wide = torch.randn(5, 700)
    rows = wide[:, :576]
    weight = torch.randn(576)
    torch.testing.assert_close(kernels.rms_norm(rows, weight, 1e-6), _torch_norm(rows.contiguous(), weight, 1e-6),
                               rtol=2 * _ulps(torch.float32), atol=0)


def _torch_norm(x, weight, eps):
    norm = RMSNorm(x.shape[-1], eps)
    norm.weight.data = weight
    return norm(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (8, 1, 32)])
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_rope_store_rotates_as_the_layer_and_stores_as_store_kv(kernels, dtype, heads, kv_heads, dim, tokens):
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(tokens, width).to(dtype)
    q, k, v = (x.view(tokens, -1, dim) for x in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    positions = torch.randint(0, 4000, (tokens,))
    rotary = _rotary(dim)
    cos_sin = rotary(positions, dtype)
    expected_q, expected_k = RotaryEmbedding.apply(q, k, cos_sin)
    expected_v = v.clone()
    caches = [torch.zeros(6, 16, kv_heads, dim, dtype=dtype) for _ in range(4)]
    slots = torch.randperm(96)[:tokens]
    slots[0] = -1  # a padding token: not stored
    reference.store_kv(expected_k, expected_v, caches[2], caches[3], slots)

    assert kernels.rope_store(q, k, v, *cos_sin, caches[0], caches[1], slots)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(v, expected_v)


def _rotary(dim: int) -> RotaryEmbedding:
    class Config:
        max_position_embeddings = 8192
        rope_parameters = {"rope_type": "default", "rope_theta": 100000.0}

    return RotaryEmbedding(Config(), dim)


@pytest.mark.parametrize("why", ["partial rotary", "separate projections", "quantized cache", "float16", "int32 slots"])
def test_rope_store_refuses_what_it_cannot_do_and_touches_nothing(kernels, why):
    tokens, heads, kv_heads, dim = 3, 4, 2, 64
    dtype = torch.float16 if why == "float16" else torch.float32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    q, k, v = (x.view(tokens, -1, dim) for x in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    if why == "separate projections":
        k = k.contiguous()
    cos, sin = _rotary(32 if why == "partial rotary" else dim)(torch.arange(tokens), dtype)
    cache_dtype = torch.uint8 if why == "quantized cache" else dtype
    k_cache, v_cache = (torch.zeros(2, 16, kv_heads, dim, dtype=cache_dtype) for _ in range(2))
    slots = torch.arange(tokens, dtype=torch.int32 if why == "int32 slots" else torch.int64)
    before = qkv.clone()
    assert not kernels.rope_store(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(qkv, before) and not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 17])
def test_silu_mul_is_the_mlps_activation(kernels, dtype, rows):
    gate_up = (torch.randn(rows, 2 * 1536) * 3).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = kernels.silu_mul(gate_up)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2 * _ulps(dtype), atol=1e-6)


def test_what_the_kernels_do_not_take_is_none(kernels):
    assert kernels.rms_norm(torch.randn(2, 3, 64), torch.ones(64), 1e-6) is None  # per-head norms (Qwen3)
    assert kernels.rms_norm(torch.randn(2, 64).half(), torch.ones(64).half(), 1e-6) is None
    assert kernels.silu_mul(torch.randn(4, 16)[:, :8]) is None


def _int8_layer(rows_out: int, width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (rows_out, width), generator=gen, dtype=torch.int8)
    scale = (torch.rand(rows_out, generator=gen) / 50 + 1e-3).bfloat16()
    return codes, scale


@pytest.mark.parametrize("width", [576, 100, 1536, 2048 + 40])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_int8_linear_is_the_grids_exact_product_to_float32_rounding(kernels, width, rows):
    """Inputs at int16 per group of 256 values: within a few 1e-4 of the exact product even with an
    outlier 10^4 times its group's other values (torch's int8 kernel, from bfloat16 inputs, is
    ~3e-3 off); widths off the group and the vector step included."""
    codes, scale = _int8_layer(96, width)
    x = torch.randn(rows, width) * torch.logspace(-2, 1, width)  # values of very different sizes
    x[0, 7] = 300.0  # an outlier in one group
    bias = torch.randn(96)
    exact = (x.double() @ (codes.double() * scale.double()[:, None]).T + bias.double()).float()
    got = kernels.int8_linear(x, kernels.int8_panels(codes), scale, bias)
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    assert float((got - exact).norm() / exact.norm()) < 5e-4
    bf16 = kernels.int8_linear(x.bfloat16(), kernels.int8_panels(codes), scale, bias.bfloat16())
    assert bf16.dtype == torch.bfloat16 and float((bf16.float() - exact).norm() / exact.norm()) < 5e-3


def test_int8_linear_gives_a_row_the_same_bits_alone_and_in_any_batch(kernels):
    """The engine's batched output must equal its unbatched one: a row's result depends on that row
    alone, whatever the batch's size (past the kernel's tile of 32 rows too)."""
    codes, scale = _int8_layer(80, 576, seed=1)
    panels = kernels.int8_panels(codes)
    batch = torch.randn(70, 576)
    together = kernels.int8_linear(batch, panels, scale, None)
    for i in (0, 31, 32, 69):
        assert torch.equal(kernels.int8_linear(batch[i : i + 1], panels, scale, None)[0], together[i])
    assert torch.equal(kernels.int8_linear(batch[30:35], panels, scale, None), together[30:35])


@pytest.mark.parametrize("arch", ["haswell", "x86-64"])
def test_int8_linear_is_the_same_with_avx2_or_plain_c_as_with_this_cpus_instructions(kernels, tmp_path, arch):
    """Group sums are exact integers and groups are added in order, so a CPU with AVX2 only (a CI
    machine, say), or without vector instructions the kernel knows, computes the bits this one does.
    Built here for Haswell (AVX2 + FMA) and for plain x86-64 (the C loops); rows past the kernel's
    tile of 4 and a width that is odd and off the group. The float32 kernel too: each output summed
    over its inputs in order, one fused multiply-add each, whatever the vector width."""
    other = built_for(arch, ("int8_linear.c", "float_linear.c", "layer_ops.c"), ("int8_linear", "float_linear"), tmp_path)
    for outs, width, rows in ((64, 2048 + 40, 5), (40, 577, 9)):
        codes, scale = _int8_layer(outs, width, seed=2)
        panels = kernels.int8_panels(codes)
        x = torch.randn(rows, width)
        assert torch.equal(other.int8_linear(x, panels, scale, None), kernels.int8_linear(x, panels, scale, None))
        weight, bias = torch.randn(outs, width), torch.randn(outs)
        for dtype in (torch.float32, torch.bfloat16):
            panels_at, x_at, bias_at = kernels.float_panels(weight.to(dtype)), x.to(dtype), bias.to(dtype)
            assert torch.equal(other.float_linear(x_at, panels_at, outs, bias_at),
                               kernels.float_linear(x_at, panels_at, outs, bias_at))


@pytest.mark.parametrize("width", [576, 100, 1])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 70])
def test_float_linear_is_the_product_and_a_rows_bits_do_not_depend_on_its_batch(kernels, width, rows):
    """The float kernel (``csrc/float_linear.c``): float32 within float32 rounding of the exact
    product, bfloat16 the float32 product of its values rounded once (as torch's bfloat16 matmul:
    within an ulp of it); every row the same alone as in a batch (tiles of 1 to 8 rows, outputs
    off the panel of 32)."""
    gen = torch.Generator().manual_seed(width + rows)
    weight, bias, x = torch.randn(70, width, generator=gen), torch.randn(70, generator=gen), torch.randn(rows, width, generator=gen)
    panels = kernels.float_panels(weight)
    got = kernels.float_linear(x, panels, 70, bias)
    exact = (x.double() @ weight.double().T + bias.double()).float()
    assert got.shape == (rows, 70) and float((got - exact).norm() / exact.norm()) < 1e-6
    for i in range(rows):
        assert torch.equal(kernels.float_linear(x[i : i + 1], panels, 70, bias)[0], got[i])
    wb, xb, bb = weight.bfloat16(), x.bfloat16(), bias.bfloat16()
    bf16 = kernels.float_linear(xb, kernels.float_panels(wb), 70, bb)
    assert bf16.dtype == torch.bfloat16
    reference = (xb.double() @ wb.double().T + bb.double()).bfloat16()
    assert float((bf16.float() - reference.float()).abs().max()) <= float(reference.float().abs().max()) * 2**-7
    assert torch.equal(kernels.float_linear(xb[-1:], kernels.float_panels(wb), 70, bb)[0], bf16[-1])
    assert kernels.float_linear(xb, panels, 70, bb) is None  # float32 panels, bfloat16 rows
    with pytest.raises(ValueError, match="do not hold"):
        kernels.float_linear(x, weight, 70, bias)


@pytest.mark.parametrize("outs, width", [(16, 64), (33, 7), (64, 576), (1, 1)])
def test_int8_panels_hold_the_codes_and_zeros_around_them(outs, width):
    """The kernel's layout: 32 outputs side by side per pair of inputs; whatever pads a panel or an
    odd width is zero (it is multiplied in), and the layout undone gives the codes back."""
    codes, _ = _int8_layer(outs, width)
    panels = NativeLayerOps.int8_panels(codes)
    assert panels.shape == (-(-outs // 32), (width + 1) // 2, 32, 2)
    assert torch.equal(panels[0, 0, 0], codes[0, :2]) if width > 1 else int(panels[0, 0, 0, 1]) == 0
    assert int(panels.abs().sum()) == int(codes.abs().sum())
    assert torch.equal(NativeLayerOps.int8_codes(panels, outs, width), codes)


def test_int8_linear_refuses_what_it_cannot_take(kernels):
    codes, scale = _int8_layer(16, 64)
    panels = kernels.int8_panels(codes)
    assert kernels.int8_linear(torch.randn(4, 128)[:, :64], panels, scale, None) is None  # rows not contiguous
    assert kernels.int8_linear(torch.randn(4, 64).half(), panels, scale, None) is None
    assert kernels.int8_linear(torch.randn(4, 64), panels, scale.float(), None) is None
    with pytest.raises(ValueError, match="do not hold"):  # codes not in the kernel's layout
        kernels.int8_linear(torch.randn(4, 64), codes, scale, None)


def test_an_empty_batch_passes_through_every_kernel(kernels):
    """A step can hand a layer no rows (the head when no sequence samples): every kernel answers
    with an empty result, never a refusal or a crash."""
    codes, scale = _int8_layer(16, 64)
    assert kernels.int8_linear(torch.empty(0, 64), kernels.int8_panels(codes), scale, None).shape == (0, 16)
    assert kernels.rms_norm(torch.empty(0, 64), torch.ones(64), 1e-6).shape == (0, 64)
    assert kernels.silu_mul(torch.empty(0, 32)).shape == (0, 16)
    qkv = torch.empty(0, 4 * 64)
    q, k, v = (x.view(0, x.shape[1] // 64, 64) for x in qkv.split([128, 64, 64], dim=-1))
    cos, sin = _rotary(64)(torch.empty(0, dtype=torch.int64), torch.float32)
    caches = torch.zeros(2, 16, 1, 64), torch.zeros(2, 16, 1, 64)
    assert kernels.rope_store(q, k, v, cos, sin, *caches, torch.empty(0, dtype=torch.int64))
