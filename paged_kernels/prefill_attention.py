"""Triton: causal attention for variable-length query chunks over the paged cache.

Each sequence's chunk holds its last ``q_len`` positions; the earlier ``seq_len - q_len`` tokens
(a prefix-cache hit or earlier chunks) and the chunk itself are read from the cache through the
block table, so the chunk's K/V must be stored first. Grid ``(num_seqs, query tiles, num_heads)``;
each program walks key tiles up to its causal limit (from the start of its earliest row's window,
with ``window`` > 0: sliding-window attention) with an online softmax in float32 and powers of
two, scores and weighted values as matrix products in the queries' type (IEEE float32 for
float32). Only the tiles that cross the diagonal or the window's edge are masked; soft-capping is
compiled in only where a model asks for it (it costs an exponential and a division per score).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.checks import check_cache, check_heads, check_same, check_tables
from pagedserve.kernels.kv_format import AUTO, KVFormat
from pagedserve.kernels.paged_tiles import (MIN_DOT, capped, code_constants, dot_in_float32, dot_pad, load_kv_tile,
                                            tile_scores, tile_weighted)

NUM_WARPS = 8
LOG2E = tl.constexpr(1.4426950408889634)  # the softmax in powers of two: exp(x) = exp2(x * log2(e))


def prefill_tiles(dim_pad: int, max_query_len: int, quantized: bool = False) -> tuple[int, int]:
    """(query rows, key positions) per tile, at 8 warps: as wide as Hopper's wgmma takes them without
    a register spill at sm_90 (tests/kernels/test_register_budget.py). Heads up to 128 in chunks past
    64 tokens: 128 x 64, each of the two warpgroups taking 64 whole rows (m64n64 products for the
    scores, m64n128 for the weighted values; 64 x 32 split the keys across the warpgroups into
    m64n16). Shorter chunks and quantized caches (their decoding holds more registers) 64 x 32;
    heads of 256 64 x 32 (16 x 32 from a quantized cache, on mma.sync: 64 rows spilled); larger
    heads 16 x 32."""
    if dim_pad <= 128:
        return (128, 64) if max_query_len > 64 and not quantized else (64, 32)
    if dim_pad <= 256 and not quantized:
        return 64, 32
    return 16, 32


PACKED_ROWS = 64  # a chunk's query rows times its group's heads up to which the heads share one program


def packed_tiles(dim_pad: int, max_query_len: int, group: int, quantized: bool = False) -> tuple[int, int, int] | None:
    """(rows, key positions, heads a KV head's rows hold) per tile where a KV head's query heads
    share one program (short chunks: a step checking drafts, a prompt's last few tokens), so each K/V
    tile is read once for the group instead of once per head; None where each head takes its own
    (one head per KV head, or chunks too long for the rows). Key tiles of 64 for heads up to 128 from
    a 16-bit cache, else 32 (an 8-bit cache's decoding at 64 rows of 64 spilled inside the loop)."""
    group_pad = triton.next_power_of_2(group)
    if group == 1 or max_query_len * group_pad > PACKED_ROWS:
        return None
    keys = 64 if dim_pad <= 128 and not quantized else 32
    return max(MIN_DOT, triton.next_power_of_2(max_query_len * group_pad)), keys, group_pad


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, starts_ptr, scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_kb, stride_kt, stride_kh, window, softcap,
    GROUP: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CODE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
    F32: tl.constexpr, SOFTCAP: tl.constexpr, GROUP_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    tile_m = tl.program_id(1)
    q_start = tl.load(starts_ptr + seq).to(tl.int64)
    q_len = (tl.load(starts_ptr + seq + 1) - q_start).to(tl.int32)
    kv_head, head, query, row_ok, span = _tile_rows(tile_m, q_len, GROUP, BLOCK_M, GROUP_PAD)
    if tile_m * span < q_len:
        seq_len = tl.load(lens_ptr + seq)
        prefix = seq_len - q_len
        d = tl.arange(0, DIM_PAD)
        q = tl.load(q_ptr + (q_start + query)[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=row_ok[:, None] & (d[None, :] < DIM), other=0.0)
        q_pos = prefix + query
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running maxima and sums in powers of two
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
        first = prefix + tile_m * span  # the tile's first row's position
        limit = tl.minimum(seq_len, first + span)  # last key any row of the tile sees, plus one
        lowest = tl.where(window > 0, tl.maximum(first - window + 1, 0), 0)  # first key any row sees
        # Keys every row sees: from where the last row's window starts to the first row's own position.
        # Tiles wholly inside take no mask; the window's edge and the diagonal take one.
        diagonal = first // BLOCK_N * BLOCK_N
        start = lowest // BLOCK_N * BLOCK_N
        whole = tl.where(window > 0, tl.minimum(tl.cdiv(tl.maximum(first + span - window, 0), BLOCK_N) * BLOCK_N,
                                                diagonal), start)
        for part in tl.static_range(3):  # the window's edge (masked), the keys every row sees, the diagonal (masked)
            if part == 0:
                lo, hi = start, whole
            elif part == 1:
                lo, hi = whole, diagonal
            else:
                lo, hi = diagonal, limit
            for tile in range(lo, hi, BLOCK_N):
                m, l, acc = _attend(q, m, l, acc, k_ptr, v_ptr, tables_ptr, seq, stride_bt, stride_kb, stride_kt,
                                    stride_kh, kv_head, d, tile, q_pos, lowest, limit, window, scale, softcap, DIM,
                                    BLOCK_SIZE, BLOCK_N, CODE, MANT, BIAS, F32, SOFTCAP, part != 1)
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(out_ptr + (q_start + query)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (d[None, :] < DIM))


@triton.jit
def _tile_rows(tile_m, q_len, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_PAD: tl.constexpr):
    """Which rows a program holds: ``(kv_head, head, query, row_ok, span)``: its KV head, each row's
    query head (one for the program, or a column of them where ``GROUP_PAD`` packs a KV head's query
    heads into the rows, so each K/V tile is read once for all of them), each row's query within the
    chunk, which rows are real, and how many query positions a tile holds."""
    if GROUP_PAD:
        kv_head = tl.program_id(2).to(tl.int64)
        span: tl.constexpr = BLOCK_M // GROUP_PAD
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        query = rows // GROUP_PAD
        head = (kv_head * GROUP + rows % GROUP_PAD)[:, None]
        row_ok = (query < q_len) & (rows % GROUP_PAD < GROUP)
    else:
        head = tl.program_id(2).to(tl.int64)
        kv_head = head // GROUP
        span: tl.constexpr = BLOCK_M
        query = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = query < q_len
    return kv_head, head, query, row_ok, span


@triton.jit
def _attend(q, m, l, acc, k_ptr, v_ptr, tables_ptr, seq, stride_bt, stride_kb, stride_kt, stride_kh, kv_head, d, tile,
            q_pos, lowest, limit, window, scale, softcap, DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            BLOCK_N: tl.constexpr, CODE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, F32: tl.constexpr,
            SOFTCAP: tl.constexpr, MASKED: tl.constexpr):
    """One key tile into the online softmax ``(m, l, acc)``. ``MASKED``: the tile crosses the causal
    diagonal or the window's edge (each score checked); otherwise every row sees every key."""
    pos = tile + tl.arange(0, BLOCK_N)
    valid = (pos < limit) & (pos >= lowest)  # before the window: never read (its blocks may be released)
    k, k_scale, v, v_scale = load_kv_tile(k_ptr, v_ptr, tables_ptr, seq, stride_bt, stride_kb, stride_kt, stride_kh,
                                          kv_head, pos, valid, d, DIM, BLOCK_SIZE, CODE, MANT, BIAS)
    if SOFTCAP:
        scores = capped(tile_scores(q, k, k_scale, scale, F32), softcap) * LOG2E
    else:
        scores = tile_scores(q, k, k_scale, scale * LOG2E, F32)
    if MASKED:
        allowed = (pos[None, :] <= q_pos[:, None]) & valid[None, :]
        allowed &= (window <= 0) | (pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows see no key at all
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tile_weighted(p, v, v_scale, q.dtype, F32)
    return m_new, l, acc


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
    packed = packed_tiles(dim_pad, max_q, group, kv_format.quantized)
    if packed is not None:
        block_m, block_n, group_pad = packed
        grid = (num_seqs, triton.cdiv(max_q * group_pad, block_m), q.shape[1] // group)
    else:
        (block_m, block_n), group_pad = prefill_tiles(dim_pad, max_q, kv_format.quantized), 0
        grid = (num_seqs, triton.cdiv(max_q, block_m), q.shape[1])
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), window, float(softcap),
        GROUP=group, DIM=q.shape[2], DIM_PAD=dim_pad, BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
        F32=dot_in_float32(q.dtype), SOFTCAP=softcap > 0.0, GROUP_PAD=group_pad, **code_constants(kv_format, q.device),
        num_warps=NUM_WARPS,
    )
    return out
