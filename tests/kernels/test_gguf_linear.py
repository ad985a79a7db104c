"""A GGUF file's quantized blocks executed as stored (``csrc/gguf_linear.c``, ``worker/runner/cpu/gguf_linear.py``):
every format the kernel runs, held to the ``gguf`` package's own dequantization of the same blocks.

K-quant blocks are random bytes with sane half-precision scales (every byte pattern of the rest is a
valid block: 4- and 6-bit codes, 6-bit and int8 sub-block scales), so each bit of each field is
exercised; Q8_0 blocks come from ``gguf.quantize``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.kernels.native_layer_ops import GGUF_KERNEL_TYPES
from pagedserve.worker.runner.cpu.gguf_linear import GEMM_ROWS_AVX2, GEMM_ROWS_AVX512, DecodeScratch, GgufEmbedding, GgufLinear, GgufMatrix
from tests.kernels.other_builds import built_for

gguf = pytest.importorskip("gguf")
BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210, "Q8_0": 34}  # per 256 values for K-quants, per 32 for Q8_0


@pytest.fixture(scope="module", params=["this cpu", "haswell", "x86-64"])
def any_build(request, kernels, tmp_path_factory):
    """The kernel as this CPU runs it, and built for AVX2 (Haswell) and for plain x86-64: each
    instruction set's path (AVX-512 VNNI, AVX2 and its byte planes, C) held to the same reference,
    whatever CPU runs the tests."""
    if request.param == "this cpu":
        return kernels
    return built_for(request.param, ("gguf_linear.c",), ("gguf_linear", "gguf_dequantize_rows"),
                     tmp_path_factory.mktemp(request.param))


def blocks(kind: str, rows: int, width: int, seed: int = 0) -> np.ndarray:
    """uint8 ``[rows, row bytes]`` of ``kind``: random codes and sub-scales, half scales near 1e-2."""
    rng = np.random.default_rng(seed)
    if kind == "Q8_0":
        return gguf.quantize(rng.standard_normal((rows, width), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    raw = rng.integers(0, 256, size=(rows, width // 256, BLOCK_BYTES[kind]), dtype=np.uint8)
    halves = lambda n: rng.uniform(1e-3, 2e-2, size=(rows, width // 256, n)).astype(np.float16).view(np.uint8)
    if kind == "Q4_K":  # d, dmin first
        raw[..., 0:4] = halves(2)
    else:  # Q6_K: d last
        raw[..., 208:210] = halves(1)
    return raw.reshape(rows, -1)


def dequantized(kind: str, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.dequantize(raw, gguf.GGMLQuantizationType[kind]))


def matrix(kind: str, rows: int, width: int, seed: int = 0) -> GgufMatrix:
    return GgufMatrix(GGUF_KERNEL_TYPES[kind], torch.from_numpy(blocks(kind, rows, width, seed)), width)


def int16_bound(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What the kernel's int16 input may change an output by: each input within half a step of its
    group of 256 (largest / 32767), times the weights' magnitudes; plus float32 rounding of the sums."""
    step = x.abs().reshape(x.shape[0], -1, 256).amax(dim=-1).repeat_interleave(256, dim=-1) / 32767
    exact = x.double() @ weight.double().T
    return (0.5 * step.double()) @ weight.abs().double().T + 1e-5 * (x.abs().double() @ weight.abs().double().T) + 1e-6 * exact.abs()


@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_decoded_rows_are_the_gguf_packages_dequantization_bit_for_bit(any_build, kind):
    raw = blocks(kind, 40, 512)
    want = dequantized(kind, raw)
    got = any_build.gguf_rows(torch.from_numpy(raw), GGUF_KERNEL_TYPES[kind], None, 512, torch.float32)
    assert torch.equal(got, want)
    picked = any_build.gguf_rows(torch.from_numpy(raw), GGUF_KERNEL_TYPES[kind], torch.tensor([7, 0, 39, 7]), 512,
                               torch.bfloat16)
    assert torch.equal(picked, want[[7, 0, 39, 7]].bfloat16())


@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17])
def test_the_product_is_the_dequantized_weight_times_the_input_within_its_int16_rounding(any_build, kind, rows):
    part = matrix(kind, 70, 768, seed=rows)
    weight = dequantized(kind, part.blocks.numpy())
    layer = GgufLinear([part], any_build, DecodeScratch())
    x = torch.randn(rows, 768) * torch.logspace(-2, 1, 768)  # groups whose values span three decades
    err = (layer(x).double() - x.double() @ weight.double().T).abs()
    assert (err <= int16_bound(weight, x)).all(), (err / int16_bound(weight, x)).max()


@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_a_row_gives_the_same_bits_alone_and_in_any_batch_under_the_gemm_size(any_build, kind):
    layer = GgufLinear([matrix(kind, 48, 512)], any_build, DecodeScratch())
    x = torch.randn(layer.scratch.gemm_rows[torch.float32] - 1, 512)
    batch = layer(x)
    for r in (0, 5, x.shape[0] - 1):
        assert torch.equal(layer(x[r:r + 1]), batch[r:r + 1])
    assert torch.equal(layer(x[:7]), batch[:7])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_batch_decodes_the_matrix_and_multiplies_it(any_build, dtype):
    """From the scratch's ``gemm_rows`` the weight is decoded (at the input's dtype) and multiplied by
    torch's GEMM, a slice of rows at a time: the product of the decoded weight, bias added."""
    part = matrix("Q4_K", 96, 512)
    bias = torch.randn(96).to(dtype)
    layer = GgufLinear([part], any_build, DecodeScratch({dtype: 20}), bias)
    x = torch.randn(23, 512).to(dtype)
    weight = dequantized("Q4_K", part.blocks.numpy()).to(dtype)
    want = (x.float() @ weight.float().T + bias.float())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(layer(x).float(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())


def test_the_gemm_takes_over_where_this_cpu_was_measured_faster_that_way():
    """AVX-512 (or bf16 instructions): bf16 from 24 rows, float32 from 48; AVX2 only: float32 from 80,
    bf16 never (emulated there: 3-4x slower decoded than row by row at any size)."""
    from pagedserve.worker.runner.cpu.gguf_linear import gemm_rows_here

    assert gemm_rows_here(frozenset({"avx2", "fma"})) == GEMM_ROWS_AVX2 == {torch.float32: 80}
    assert gemm_rows_here(frozenset({"avx2", "avx512f"})) == GEMM_ROWS_AVX512
    assert gemm_rows_here(frozenset({"avx2", "amx_bf16"}))[torch.bfloat16] == 24


def test_with_amx_tiles_a_bf16_batch_leaves_the_kernel_only_from_64_rows(kernels):
    """Where the kernel multiplies bf16 batches on AMX tiles, oneDNN's GEMM of the decoded matrix takes
    bf16 batches only from 64 rows (the tiles are faster below); float32 as before."""
    from pagedserve.worker.runner.cpu.gguf_linear import GEMM_ROWS_AMX, gemm_rows_here

    if not kernels.gguf_tile_rows():
        assert gemm_rows_here(kernels=kernels) == gemm_rows_here()
        pytest.skip("no AMX tiles here")
    assert gemm_rows_here(kernels=kernels) == GEMM_ROWS_AMX == {torch.bfloat16: 64, torch.float32: 48}
    assert DecodeScratch(kernels=kernels).gemm_rows == GEMM_ROWS_AMX


def test_a_bf16_batch_from_the_tile_size_multiplies_on_amx_tiles(kernels):
    """Where the CPU has AMX (``gguf_tile_rows``), a bf16 batch of 12 rows or more is decoded 32 output
    rows at a time to bf16 and multiplied on tiles (``csrc/gguf_amx.c``): the decoded bf16 weight times
    the input, summed in float32 and rounded once; blocks of 32 rows and of 32 outputs and what is left
    of them, a fused layer's columns; and a row's bits the same in any batch of that size or more."""
    tile = kernels.gguf_tile_rows()
    if not tile:
        pytest.skip("no AMX tiles here")
    for kind in sorted(BLOCK_BYTES):
        part, bias = matrix(kind, 70, 768, seed=3), torch.randn(70).bfloat16()
        layer = GgufLinear([part], kernels, DecodeScratch({}), bias)  # no decoded GEMM at any size
        weight = dequantized(kind, part.blocks.numpy()).bfloat16().double()
        x = torch.randn(47, 768).bfloat16()
        got = layer(x).double()
        want = x.double() @ weight.T + bias.double()
        bound = want.abs() * 2**-8 + 1e-5 * (x.double().abs() @ weight.abs().T + 1)  # bf16's rounding, float32 sums'
        assert ((got - want).abs() <= bound).all(), kind
        for rows in (tile, 16, 17, 33):
            assert torch.equal(layer(x[:rows]), layer(x)[:rows])
    q, v = matrix("Q4_K", 64, 512, 1), matrix("Q6_K", 40, 512, 2)
    fused = GgufLinear([q], kernels, DecodeScratch({})).stacked_with([GgufLinear([v], kernels, DecodeScratch({}))])
    x = torch.randn(20, 512).bfloat16()
    assert torch.equal(fused(x), torch.cat([GgufLinear([q], kernels, DecodeScratch({}))(x),
                                            GgufLinear([v], kernels, DecodeScratch({}))(x)], dim=1))


def test_the_amx_paths_build_for_a_cpu_with_amx(tmp_path):
    """The tile paths (``csrc/gguf_amx.c``, ``csrc/float_linear.c``) are compiled only for a CPU with
    AMX: built here for Sapphire Rapids, whatever this CPU is (built, not run)."""
    built = built_for("sapphirerapids", ("gguf_linear.c", "gguf_amx.c", "float_linear.c"), (), tmp_path)
    assert hasattr(built._lib, "gguf_linear_amx") and hasattr(built._lib, "float_linear_bf16")


def test_stacked_parts_of_different_formats_write_their_own_columns(kernels):
    scratch = DecodeScratch()
    q, v = matrix("Q4_K", 64, 512, 1), matrix("Q6_K", 32, 512, 2)
    bq, bv = torch.randn(64), torch.randn(32)
    fused = GgufLinear([q], kernels, scratch, bq).stacked_with([GgufLinear([v], kernels, scratch, bv)])
    assert fused.out_features == 96 and "Q4_K+Q6_K" in repr(fused)
    for rows in (2, scratch.gemm_rows[torch.float32] + 1):  # row by row, and decoded for a GEMM
        x = torch.randn(rows, 512)
        out = fused(x)
        assert torch.equal(out[:, :64], GgufLinear([q], kernels, scratch, bq)(x))
        assert torch.equal(out[:, 64:], GgufLinear([v], kernels, scratch, bv)(x))
    assert torch.equal(fused.dequantized(), torch.cat([dequantized("Q4_K", q.blocks.numpy()),
                                                       dequantized("Q6_K", v.blocks.numpy())]))


def test_an_embedding_decodes_the_rows_it_looks_up_and_refuses_ids_out_of_range(kernels):
    table = matrix("Q6_K", 50, 256)
    embedding = GgufEmbedding(table, kernels, DecodeScratch(), torch.bfloat16)
    ids = torch.tensor([[3, 49], [0, 3]])
    assert torch.equal(embedding(ids), dequantized("Q6_K", table.blocks.numpy())[ids].bfloat16())
    with pytest.raises(IndexError, match="50 rows"):
        embedding(torch.tensor([50]))
    with pytest.raises(IndexError):
        embedding(torch.tensor([-1]))
    head = embedding.as_linear()  # a head tied to the table: the same blocks
    assert head.parts[0].blocks.data_ptr() == table.blocks.data_ptr()


def test_a_width_that_is_not_whole_super_blocks_is_refused(kernels):
    with pytest.raises(ValueError, match="cannot run"):
        GgufLinear([GgufMatrix(GGUF_KERNEL_TYPES["Q4_K"], torch.zeros(4, 144, dtype=torch.uint8), 288)], kernels,
                   DecodeScratch())


def test_the_input_is_rounded_to_the_nearest_step_not_toward_zero(any_build):
    """Inputs 0.9 of a step past a whole one, weights all positive: rounding to nearest is off by a
    tenth of a step each, truncation by nine tenths, all in one direction."""
    weight_values = np.abs(np.random.default_rng(3).standard_normal((16, 256), dtype=np.float32)) + 0.1
    part = GgufMatrix(GGUF_KERNEL_TYPES["Q8_0"], torch.from_numpy(gguf.quantize(weight_values, gguf.GGMLQuantizationType.Q8_0)), 256)
    weight = dequantized("Q8_0", part.blocks.numpy()).double()
    step = 1 / 32767
    x = torch.arange(256, dtype=torch.float64).remainder(200).add(0.9).mul(step)
    x[0] = 1.0  # the group's largest: the step is 1 / 32767
    err = (GgufLinear([part], any_build, DecodeScratch())(x.float()[None]).double() - x @ weight.T).abs()
    assert (err < 0.2 * step * weight.sum(dim=1) + 2e-6 * (x @ weight.T)).all()


def test_the_largest_products_a_block_holds_do_not_overflow_the_integer_sums(any_build):
    """Q6_K's largest weights (scale -128 times code 0 - 32: 4,096; code 63: -3,968) against inputs that
    are all their group's largest (+-32,767 once rounded), one row at a time and in a batch: an int32
    that adds more than 16 such products (or 8 of the AVX2 planes' 128 x 63 x 32,768) wraps."""
    raw = np.zeros((4, 210), dtype=np.uint8)
    raw[2:, :192] = 0xFF  # rows 2 and 3: every 6-bit code 63; rows 0 and 1: every code 0
    raw[:, 192:208] = 0x80  # sixteen int8 scales of -128
    raw[:, 208:210] = np.array([1.0], dtype=np.float16).view(np.uint8)[None]
    weight = dequantized("Q6_K", raw).double()
    assert bool((weight[:2] == 4096).all()) and bool((weight[2:] == -3968).all())
    layer = GgufLinear([GgufMatrix(GGUF_KERNEL_TYPES["Q6_K"], torch.from_numpy(raw), 256)], any_build, DecodeScratch())
    x = torch.tensor([0.5, -0.5, 0.5, -0.5, 0.5, -0.5])[:, None].repeat(1, 256)
    want = x.double() @ weight.T
    for rows in (x[:1], x[1:2], x):
        got = layer(rows).double()
        assert torch.allclose(got, want[:rows.shape[0]] if rows.shape[0] > 1 else (rows.double() @ weight.T), rtol=1e-5), got
