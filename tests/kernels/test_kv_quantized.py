"""A quantized KV cache (``paged_kernels/kv_format.py``): codes and scales round trip within the format's
step, and every CPU backend attends over the quantized blocks exactly as plain attention over the
whole cache decoded up front (block sizes 1/7/16, GQA and MHA, sliding window, soft cap)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.kernels.kv_format import FORMATS, kv_format
from pagedserve.kernels.native_attention import NativeAttention
from pagedserve.kernels.native_build import NativeKernelUnavailable
from pagedserve.kernels.ops import reference_ops
from tests.paged_cases import quantized_case

QUANTIZED = ["int8", "fp8_e4m3", "fp8_e5m2"]
RELATIVE_STEP = {"int8": 1 / 127, "fp8_e4m3": 2**-3, "fp8_e5m2": 2**-2}  # of the row's absmax / of the value


@pytest.fixture(scope="module")
def native_for(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kernels")

    def build(name: str) -> NativeAttention:
        try:
            return NativeAttention(folder, kv_format(name))
        except NativeKernelUnavailable as err:
            pytest.skip(f"no native kernels here: {err}")

    return build


def test_the_names_are_vllms_plus_int8():
    assert kv_format("fp8") is FORMATS["fp8_e4m3"] and not kv_format("auto").quantized
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, int8"):
        kv_format("fp4")


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_cuda_cache_pads_its_rows_to_16_bytes_past_the_codes(name):
    """CUDA's rows: the codes, the scale, 14 zero bytes (16-byte aligned loads at a head a multiple of
    16); the same codes and scale as the CPU's tight rows, read back the same."""
    tight, aligned = kv_format(name), kv_format(name, torch.device("cuda", 1))
    assert kv_format(name, "cpu") is tight and kv_format("auto", "cuda") is FORMATS["auto"]
    assert (tight.tail, aligned.tail, aligned.row_width(128), tight.row_width(128)) == (2, 16, 144, 130)
    values = torch.randn(3, 2, 128) * 5
    rows = aligned.quantize(values)
    assert rows.shape == (3, 2, 144) and aligned.head_dim(rows) == 128 and tight.head_dim(rows[..., :130]) == 128
    assert torch.equal(rows[..., :130], tight.quantize(values)) and not rows[..., 130:].any()
    assert torch.equal(aligned.dequantize(rows), tight.dequantize(rows[..., :130]))
    assert aligned.aligned() == aligned and aligned.bytes_per_element(torch.bfloat16) == 1


@pytest.mark.parametrize("name", QUANTIZED)
def test_rows_round_trip_within_a_step(name):
    fmt = kv_format(name)
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]
    x[0] = 0  # an all-zero row decodes to zeros
    rows = fmt.quantize(x)
    assert rows.dtype == torch.uint8 and rows.shape == (50, 3, 66)
    back = fmt.dequantize(rows)
    absmax = x.abs().amax(-1, keepdim=True)
    if name == "int8":
        bound = absmax * (RELATIVE_STEP[name] / 2 + 4e-3)  # half a step; the largest may clamp by the scale's rounding
    else:
        bound = x.abs() * RELATIVE_STEP[name] / 2 + absmax * 4e-3 + absmax / fmt.largest * 2**-6  # and subnormals
    assert bool((back - x).abs().le(bound).all())
    assert bool(back[0].eq(0).all())
    # Rounded, not truncated: a quarter of a step off on average and no lean toward zero (measured 0.25 and
    # -0.002 steps for int8, 0.18 and -0.002 / -0.011 for the fp8s; truncating leans by about half a step).
    step = absmax * RELATIVE_STEP[name] if name == "int8" else x.abs() * RELATIVE_STEP[name]
    seen = (step > 0).expand_as(x)
    off = ((back - x) / step.clamp_min(1e-30))[seen]
    toward_zero = ((x - back) * x.sign() / step.clamp_min(1e-30))[seen]
    assert float(off.abs().mean()) < 0.3 and abs(float(toward_zero.mean())) < 0.05


def backends(name: str, native_for):
    ops = reference_ops(kv_format(name))
    native = native_for(name)
    return {"torch": (ops.decode, ops.prefill), "native": (native.decode, native.prefill)}


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (16, 0.0), (0, 2.0)])
def test_every_backend_reads_quantized_blocks_as_the_decoded_cache(native_for, name, block_size, heads, kv_heads,
                                                                   window, softcap):
    lengths = [1, 9, 16, 17, 40, 97]
    case, k_rows, v_rows = quantized_case(name, block_size, kv_heads, lengths)
    q = torch.randn(len(lengths), heads, 64) * (3.0 if softcap else 1.0)
    expected = reference.paged_attention_decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.125,
                                                window=window, softcap=softcap)
    starts = torch.tensor([0, 1, 3, 8, 9, 25, 41], dtype=torch.int32)  # chunks of 1, 2, 5, 1, 16, 16 tokens
    qp = torch.randn(41, heads, 64)
    expected_prefill = reference.prefill_attention(qp, case.k_cache, case.v_cache, case.block_tables, starts,
                                                   case.seq_lens, 0.125, window=window, softcap=softcap)
    for backend, (decode, prefill) in backends(name, native_for).items():
        out = decode(q, k_rows, v_rows, case.block_tables, case.seq_lens, 0.125, window=window, softcap=softcap)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5, msg=f"{backend} decode")
        out = prefill(qp, k_rows, v_rows, case.block_tables, starts, case.seq_lens, 0.125, window=window,
                      softcap=softcap)
        torch.testing.assert_close(out, expected_prefill, atol=2e-5, rtol=2e-5, msg=f"{backend} prefill")


def test_bfloat16_queries_read_a_quantized_cache_natively(native_for):
    case, k_rows, v_rows = quantized_case("int8", 16, 2, [5, 40, 97])
    q = torch.randn(3, 4, 64).to(torch.bfloat16)
    native = native_for("int8")
    assert native.supports(q, k_rows)
    out = native.decode(q, k_rows, v_rows, case.block_tables, case.seq_lens, 0.125)
    expected = reference.paged_attention_decode(q.float(), case.k_cache, case.v_cache, case.block_tables,
                                                case.seq_lens, 0.125)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


def test_a_formats_layout_sizes_rotation_and_table():
    """What each format stores, per row and per element; its rotation (orthogonal, on the device
    asked for, none at the model's dtype) and its code table (on the CPU unless told)."""
    auto, int8 = kv_format("auto"), kv_format("int8")
    assert (auto.row_width(64), int8.row_width(64)) == (64, 66)  # the scale's two bytes
    assert auto.bytes_per_element(torch.bfloat16) == 2 and auto.bytes_per_element(torch.float32) == 4
    assert int8.bytes_per_element(torch.float32) == 1 == kv_format("fp8_e5m2").bytes_per_element(torch.bfloat16)
    assert auto.rotation(64) is None
    for dim in (64, 48):  # Hadamard with signs; a seeded orthogonal matrix
        turn = int8.rotation(dim, "meta" if dim == 48 else "cpu")
        assert turn.shape == (dim, dim) and turn.device.type == ("meta" if dim == 48 else "cpu")
    turn = int8.rotation(64)
    assert torch.allclose(turn @ turn.T, torch.eye(64), atol=1e-5) and turn.device.type == "cpu"
    table = kv_format("fp8_e4m3").table()
    assert table.device.type == "cpu" and table.shape == (256,) and table.nan_to_num(0.0).max() == 448.0
    assert int8.table("meta").device.type == "meta"


def test_quantized_pairs_keep_keys_and_values_apart_and_dequantize_into_a_buffer():
    fmt = kv_format("int8")
    key, value = torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(1)), torch.zeros(3, 2, 64)
    rows_k, rows_v = fmt.quantize_pair(key, value)
    assert torch.equal(rows_k, fmt.quantize(key)) and torch.equal(rows_v, fmt.quantize(value))
    assert torch.all(rows_v[..., -2:].contiguous().view(torch.bfloat16).float() == 2.0 ** -126)  # a zero row's scale
    out = torch.full((3, 2, 64), 7.0)
    assert fmt.dequantize(rows_k, out=out) is out and torch.equal(out, fmt.dequantize(rows_k))
    assert torch.equal(fmt.dequantize(rows_v), value)
