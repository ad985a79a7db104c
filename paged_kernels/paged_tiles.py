"""Triton helpers shared by the attention kernels: K and V of a tile of token positions, read
through a block table (one block id per position, so any power-of-two block size works) and,
from a quantized cache, decoded in registers (``CODE``, ``code_constants``), and score soft-capping.
"""

import math

import torch
import triton
import triton.language as tl

from pagedserve.kernels.kv_format import KVFormat

PLAIN, INT8, FP8 = 0, 1, 2


def code_constants(kv_format: KVFormat) -> dict:
    """The ``CODE``, ``MANT`` and ``BIAS`` constexprs ``load_kv_tile`` decodes ``kv_format``'s rows with."""
    if not kv_format.quantized:
        return {"CODE": PLAIN, "MANT": 0, "BIAS": 0}
    if kv_format.code == torch.int8:
        return {"CODE": INT8, "MANT": 0, "BIAS": 0}
    info = torch.finfo(kv_format.code)  # eps = 2**-mantissa bits, tiny (the least normal) = 2**(1 - bias)
    return {"CODE": FP8, "MANT": round(-math.log2(info.eps)), "BIAS": round(1 - math.log2(info.tiny))}


@triton.jit
def load_kv_tile(k_ptr, v_ptr, tables_ptr, seq, stride_bt, stride_kb, stride_kt, stride_kh, kv_head, pos, valid, d,
                 DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, CODE: tl.constexpr, MANT: tl.constexpr,
                 BIAS: tl.constexpr):
    """float32 K and V ``[len(pos), DIM_PAD]``; positions where ``valid`` is false read as zeros."""
    block = tl.load(tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    offs = block * stride_kb + (pos % BLOCK_SIZE).to(tl.int64) * stride_kt + kv_head * stride_kh
    kv_mask = valid[:, None] & (d[None, :] < DIM)
    k = _load_rows(k_ptr, offs, d, valid, kv_mask, DIM, CODE, MANT, BIAS)
    v = _load_rows(v_ptr, offs, d, valid, kv_mask, DIM, CODE, MANT, BIAS)
    return k, v


@triton.jit
def _load_rows(ptr, offs, d, valid, mask, DIM: tl.constexpr, CODE: tl.constexpr, MANT: tl.constexpr,
               BIAS: tl.constexpr):
    """float32 ``[len(offs), DIM_PAD]``: plain values, or one-byte codes times the row's bfloat16
    scale (the two bytes after the codes; ``paged_kernels/kv_format.py``), decoded with integer
    arithmetic only, as exact as the torch reference's table."""
    if CODE == 0:
        return tl.load(ptr + offs[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    codes = tl.load(ptr + offs[:, None] + d[None, :], mask=mask, other=0).to(tl.int32)
    low = tl.load(ptr + offs + DIM, mask=valid, other=0).to(tl.uint32)
    high = tl.load(ptr + offs + DIM + 1, mask=valid, other=0).to(tl.uint32)
    scale = ((high << 24) | (low << 16)).to(tl.float32, bitcast=True)  # a bfloat16 is float32's upper half
    if CODE == 1:
        values = (codes - ((codes >> 7) << 8)).to(tl.float32)  # the byte as two's complement
    else:
        exponent = (codes >> MANT) & ((1 << (7 - MANT)) - 1)
        significand = (codes & ((1 << MANT) - 1)) + tl.where(exponent > 0, 1 << MANT, 0)  # subnormals: no implicit 1
        power = ((tl.maximum(exponent, 1) - BIAS - MANT + 127) << 23).to(tl.float32, bitcast=True)
        values = tl.where(codes >= 128, -1.0, 1.0) * significand.to(tl.float32) * power
    return values * scale[:, None]


@triton.jit
def cap_scores(scores, softcap):
    """``softcap * tanh(scores / softcap)`` where ``softcap`` > 0 (Gemma 2), else the scores as they
    are; tanh as ``1 - 2 / (exp(2x) + 1)``, which saturates cleanly at +-1 for large |x|."""
    cap = tl.where(softcap > 0.0, softcap, 1.0)  # no division by zero on the uncapped path
    capped = cap * (1.0 - 2.0 / (tl.exp(2.0 * scores / cap) + 1.0))
    return tl.where(softcap > 0.0, capped, scores)
