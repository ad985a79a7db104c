"""Triton helpers shared by the attention kernels: K and V of a tile of token positions, read
through a block table (one block id per position, so any power-of-two block size works), and
score soft-capping."""

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(k_ptr, v_ptr, tables_ptr, seq, stride_bt, stride_kb, stride_kt, stride_kh, kv_head, pos, valid, d,
                 DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """float32 K and V ``[len(pos), DIM_PAD]``; positions where ``valid`` is false read as zeros."""
    block = tl.load(tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    offs = block * stride_kb + (pos % BLOCK_SIZE).to(tl.int64) * stride_kt + kv_head * stride_kh
    kv_mask = valid[:, None] & (d[None, :] < DIM)
    k = tl.load(k_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    return k, v


@triton.jit
def cap_scores(scores, softcap):
    """``softcap * tanh(scores / softcap)`` where ``softcap`` > 0 (Gemma 2), else the scores as they
    are; tanh as ``1 - 2 / (exp(2x) + 1)``, which saturates cleanly at +-1 for large |x|."""
    cap = tl.where(softcap > 0.0, softcap, 1.0)  # no division by zero on the uncapped path
    capped = cap * (1.0 - 2.0 / (tl.exp(2.0 * scores / cap) + 1.0))
    return tl.where(softcap > 0.0, capped, scores)
