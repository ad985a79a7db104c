"""Triton helpers shared by the attention kernels: K and V of a tile of token positions, read
through a block table (one block id per position, so any power-of-two block size works) and,
from a quantized cache, decoded in registers (``CODE``, ``code_constants``), and score soft-capping.
"""

import math
import os

import torch
import triton
import triton.language as tl

from pagedserve.kernels.kv_format import KVFormat

PLAIN, INT8, FP8, FP8_CONVERTED = 0, 1, 2, 3
MIN_DOT = 16  # the matrix units' least rows and columns


def code_constants(kv_format: KVFormat, device: torch.device | str = "cpu") -> dict:
    """The ``CODE``, ``MANT`` and ``BIAS`` constexprs ``load_kv_tile`` decodes ``kv_format``'s rows
    with on ``device``: fp8 codes by the hardware's conversion where it has one for the format
    (``FP8_CONVERTED``: e4m3 from sm_89 on, e5m2 everywhere, and the interpreter), else with
    integer arithmetic."""
    if not kv_format.quantized:
        return {"CODE": PLAIN, "MANT": 0, "BIAS": 0}
    if kv_format.code == torch.int8:
        return {"CODE": INT8, "MANT": 0, "BIAS": 0}
    info = torch.finfo(kv_format.code)  # eps = 2**-mantissa bits, tiny (the least normal) = 2**(1 - bias)
    mantissa, bias = round(-math.log2(info.eps)), round(1 - math.log2(info.tiny))
    device = torch.device(device)
    converts = (device.type != "cuda" or kv_format.code == torch.float8_e5m2
                or torch.cuda.get_device_capability(device) >= (8, 9))
    return {"CODE": FP8_CONVERTED if converts else FP8, "MANT": mantissa, "BIAS": bias}


@triton.jit
def tile_rows(tables_ptr, seq, stride_bt, stride_kb, stride_kt, stride_kh, kv_head, pos, valid, BLOCK_SIZE: tl.constexpr):
    """int64 ``[len(pos)]``: where each position's row of ``kv_head`` starts in a cache, its block
    looked up in the sequence's table (invalid positions: block 0's, never read unmasked)."""
    block = tl.load(tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block * stride_kb + (pos % BLOCK_SIZE).to(tl.int64) * stride_kt + kv_head * stride_kh


@triton.jit
def row_scales(ptr, offs, valid, DIM: tl.constexpr):
    """float32 ``[len(offs)]``: each quantized row's bfloat16 scale, the two bytes after its codes
    (``paged_kernels/kv_format.py``)."""
    low = tl.load(ptr + offs + DIM, mask=valid, other=0).to(tl.uint32)
    high = tl.load(ptr + offs + DIM + 1, mask=valid, other=0).to(tl.uint32)
    return ((high << 24) | (low << 16)).to(tl.float32, bitcast=True)  # a bfloat16 is float32's upper half


@triton.jit
def load_kv_tile(k_ptr, v_ptr, tables_ptr, seq, stride_bt, stride_kb, stride_kt, stride_kh, kv_head, pos, valid, d,
                 DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, CODE: tl.constexpr, MANT: tl.constexpr,
                 BIAS: tl.constexpr):
    """K and V of a tile as ``(k, k_scale, v, v_scale)``: ``[len(pos), DIM_PAD]`` values (a plain
    cache's as stored; int8 codes or decoded fp8 codes as float32, exact in any 16-bit type) and each
    row's float32 scale (ones for a plain cache). The kernels take their dot products on the
    values and apply the scales to the scores and the probabilities, so the matrix units see exact
    inputs. Positions where ``valid`` is false read as zeros."""
    offs = tile_rows(tables_ptr, seq, stride_bt, stride_kb, stride_kt, stride_kh, kv_head, pos, valid, BLOCK_SIZE)
    kv_mask = valid[:, None] & (d[None, :] < DIM)
    if CODE == 0:
        k = tl.load(k_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        k_scale = tl.full(offs.shape, 1.0, tl.float32)
        v_scale = k_scale
    else:
        k, k_scale = _load_codes(k_ptr, offs, d, valid, kv_mask, DIM, CODE, MANT, BIAS)
        v, v_scale = _load_codes(v_ptr, offs, d, valid, kv_mask, DIM, CODE, MANT, BIAS)
    return k, k_scale, v, v_scale


@triton.jit
def _load_codes(ptr, offs, d, valid, mask, DIM: tl.constexpr, CODE: tl.constexpr, MANT: tl.constexpr,
                BIAS: tl.constexpr):
    """float32 ``[len(offs), DIM_PAD]`` values and ``[len(offs)]`` scales: one-byte codes decoded
    exactly as the torch reference's table (int8 by sign extension, fp8 by the hardware's conversion,
    or integer arithmetic where it has none: ``code_constants``) and the row's scale (``row_scales``)."""
    raw = tl.load(ptr + offs[:, None] + d[None, :], mask=mask, other=0)
    scale = row_scales(ptr, offs, valid, DIM)
    if CODE == 1:
        values = raw.to(tl.int8, bitcast=True).to(tl.float32)
    elif CODE == 3:  # the hardware's conversion (code_constants)
        if MANT == 3:
            values = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            values = raw.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        codes = raw.to(tl.int32)
        exponent = (codes >> MANT) & ((1 << (7 - MANT)) - 1)
        significand = (codes & ((1 << MANT) - 1)) + tl.where(exponent > 0, 1 << MANT, 0)  # subnormals: no implicit 1
        power = ((tl.maximum(exponent, 1) - BIAS - MANT + 127) << 23).to(tl.float32, bitcast=True)
        values = tl.where(codes >= 128, -1.0, 1.0) * significand.to(tl.float32) * power
    return values, scale


def interpreted() -> bool:
    """Whether the kernels run under ``TRITON_INTERPRET=1`` (numpy on the CPU), where a few
    conversions and products need an exact path of their own (``dot_in_float32``, ``quantized_products.to_codes``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_in_float32(dtype: torch.dtype) -> bool:
    """Whether the kernels' ``tile_dot`` takes IEEE float32 products for queries of ``dtype``: for
    float32 (a float32 model's parity with transformers), and for bfloat16 under
    ``TRITON_INTERPRET=1``, whose dot reads bfloat16 operands wrongly (the products of two bfloat16
    values are exact in float32, so the result is the matrix units' up to the order of the sums)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreted())


def dot_pad(n: int) -> int:
    """``n`` rows or columns padded for ``tl.dot``: a power of two, at least the matrix units' 16."""
    return max(triton.next_power_of_2(n), MIN_DOT)


@triton.jit
def tile_dot(a, b, F32: tl.constexpr):
    """``a @ b`` summed in float32: from IEEE float32 products where ``F32`` (``dot_in_float32``), the
    matrix units' 16-bit products otherwise."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def tile_scores(q, k, k_scale, scale, F32: tl.constexpr):
    """``[rows, keys]`` scores of ``q`` against a tile's keys (``load_kv_tile``): the product on the
    exact values, then each key row's scale and the softmax scale."""
    return tile_dot(q, tl.trans(k.to(q.dtype)), F32) * (k_scale * scale)[None, :]


@triton.jit
def tile_weighted(p, v, v_scale, dtype: tl.constexpr, F32: tl.constexpr):
    """``[rows, DIM_PAD]``: probabilities ``p`` times a tile's values, each value row's scale folded
    into ``p`` before both enter the product at ``dtype`` (the queries')."""
    return tile_dot((p * v_scale[None, :]).to(dtype), v.to(dtype), F32)


@triton.jit
def capped(scores, softcap):
    """``softcap * tanh(scores / softcap)``, ``softcap`` > 0; tanh as ``1 - 2 / (exp(2x) + 1)``, which
    saturates cleanly at +-1 for large |x|."""
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
