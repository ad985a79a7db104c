"""Triton: causal attention for variable-length query chunks over the paged cache.

Each sequence's chunk holds its last ``q_len`` positions; the earlier ``seq_len - q_len`` tokens
(a prefix-cache hit or earlier chunks) and the chunk itself are read from the cache through the
block table, so the chunk's K/V must be stored first. Grid ``(num_seqs, query tiles, num_heads)``;
each program walks key tiles up to its causal limit (from the start of its earliest row's window,
with ``window`` > 0: sliding-window attention) with an online softmax in float32, scores and
weighted values as matrix products in the queries' type (IEEE float32 for float32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.checks import check_cache, check_heads, check_same, check_tables
from pagedserve.kernels.kv_format import AUTO, KVFormat
from pagedserve.kernels.paged_tiles import (cap_scores, code_constants, dot_in_float32, dot_pad, load_kv_tile, tile_scores,
                                            tile_weighted)

NUM_WARPS = 8


def prefill_tiles(dim_pad: int) -> tuple[int, int]:
    """(query rows, key positions) per tile: 64 x 32 up to heads of 128, 16 x 32 beyond (at 8 warps,
    Hopper's wgmma for the first, and no spills at sm_90 for either, plain or int8 caches:
    tests/kernels/test_register_budget.py; 64 x 64 spilled at heads of 128 with 4 warps)."""
    return (64, 32) if dim_pad <= 128 else (16, 32)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, starts_ptr, scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_kb, stride_kt, stride_kh, window, softcap,
    GROUP: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CODE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
    F32: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    tile_m = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    q_start = tl.load(starts_ptr + seq).to(tl.int64)
    q_len = (tl.load(starts_ptr + seq + 1) - q_start).to(tl.int32)
    if tile_m * BLOCK_M < q_len:
        seq_len = tl.load(lens_ptr + seq)
        prefix = seq_len - q_len
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, DIM_PAD)
        row_ok = rows < q_len
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=row_ok[:, None] & (d[None, :] < DIM), other=0.0)
        q_pos = prefix + rows
        kv_head = head // GROUP
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
        limit = tl.minimum(seq_len, prefix + (tile_m + 1) * BLOCK_M)  # last key any row of the tile sees
        lowest = tl.where(window > 0, tl.maximum(prefix + tile_m * BLOCK_M - window + 1, 0), 0)  # first key it sees
        for tile in range(lowest // BLOCK_N * BLOCK_N, limit, BLOCK_N):
            pos = tile + tl.arange(0, BLOCK_N)
            valid = (pos < limit) & (pos >= lowest)  # before the window: never read (its blocks may be released)
            k, k_scale, v, v_scale = load_kv_tile(k_ptr, v_ptr, tables_ptr, seq, stride_bt, stride_kb, stride_kt,
                                                  stride_kh, kv_head, pos, valid, d, DIM, BLOCK_SIZE, CODE, MANT, BIAS)
            scores = cap_scores(tile_scores(q, k, k_scale, scale, F32), softcap)
            allowed = (pos[None, :] <= q_pos[:, None]) & valid[None, :]
            allowed &= (window <= 0) | (pos[None, :] > q_pos[:, None] - window)
            scores = tl.where(allowed, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows see no key at all
            alpha = tl.exp(m - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tile_weighted(p, v, v_scale, q.dtype, F32)
            m = m_new
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (d[None, :] < DIM))


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_query_len: int | None = None,
    max_seq_len: int | None = None,  # part of the ops contract; each program walks its own length
    window: int = 0,
    softcap: float = 0.0,
    kv_format: KVFormat = AUTO,
) -> torch.Tensor:
    """Same contract as ``kernels.reference.prefill_attention``."""
    check_cache(k_cache, v_cache, kv_format)
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim] with unit last stride, got {tuple(q.shape)}")
    group = check_heads(q, k_cache, kv_format)
    num_seqs = seq_lens.shape[0]
    check_tables(block_tables, seq_lens, num_seqs)
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [{num_seqs + 1}], got {tuple(query_start_loc.shape)}")
    check_same(q.device, k_cache.device, block_tables.device, query_start_loc.device)
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    max_q = max_query_len if max_query_len is not None else int((query_start_loc[1:] - query_start_loc[:-1]).max())
    block_tables = block_tables.contiguous()
    dim_pad = dot_pad(q.shape[2])
    block_m, block_n = prefill_tiles(dim_pad)
    grid = (num_seqs, triton.cdiv(max_q, block_m), q.shape[1])
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), window, float(softcap),
        GROUP=group, DIM=q.shape[2], DIM_PAD=dim_pad, BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
        F32=dot_in_float32(q.dtype), **code_constants(kv_format), num_warps=NUM_WARPS,
    )
    return out
