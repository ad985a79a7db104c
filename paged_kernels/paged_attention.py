"""Triton: decode attention over the paged cache, split over the context (flash-decoding).

Grid ``(num_seqs, num_kv_heads, num_splits)``: each program takes one KV head with all the query
heads that share it (GQA) and one slice of ``partition`` context tokens (``decode_partition``: 512,
finer for a few long sequences), walks it in tiles of ``decode_tile`` tokens (block ids looked up per
token, so any power-of-two block size works) with an online softmax in float32, the group's scores
and its weighted values as matrix products (the group padded to ``MIN_DOT`` rows), and writes a
partial result. A second kernel combines the slices, ``REDUCE_CHUNK`` at a time, so a batch of a few
long sequences still spreads over the whole GPU. The slice size and count are run-time values: one
compiled variant serves every batch and context. With ``window`` > 0 (sliding-window attention)
slices and tiles before the window are skipped and the rest masked to it. An 8-bit cache's codes are
decoded in registers (``paged_tiles``), or with ``quantized_products`` multiplied as stored
(``quantized_products.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.checks import check_cache, check_heads, check_same, check_tables
from pagedserve.kernels.decode_partitions import decode_partition, decode_splits, decode_tile
from pagedserve.kernels.kv_format import AUTO, KVFormat
from pagedserve.kernels.paged_tiles import (capped, code_constants, dot_in_float32, dot_pad, interpreted, load_kv_tile,
                                            tile_rows, tile_scores, tile_weighted)
from pagedserve.kernels.quantized_products import code_scores, code_weighted, column_codes, load_code_tile

NUM_WARPS = 8
REDUCE_CHUNK = 32  # slices the reduction reads at once


@triton.jit(do_not_specialize=["max_splits", "partition"])  # one variant for every slice count and size
def _decode_partial(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    scale, stride_qs, stride_qh, stride_bt, stride_kb, stride_kt, stride_kh, max_splits, partition, window, softcap,
    GROUP: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    CODE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, F32: tl.constexpr, SOFTCAP: tl.constexpr,
    PRODUCTS: tl.constexpr, INTERPRETED: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq)
    start = split * partition
    first = _first_key(seq_len, window)
    if (start < seq_len) & (start + partition > first):
        g = tl.arange(0, ROWS)  # the group's query heads, padded with zero rows to the matrix units' size
        d = tl.arange(0, DIM_PAD)
        heads = kv_head * GROUP + g
        q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
                    mask=(g[:, None] < GROUP) & (d[None, :] < DIM), other=0.0)
        if PRODUCTS:  # products on the codes (quantized_products.py): the queries quantized once
            q_codes, q_back = column_codes(tl.trans(q.to(tl.float32)), CODE, INTERPRETED)
        m = tl.full([ROWS], float("-inf"), tl.float32)
        l = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, DIM_PAD], tl.float32)
        end = tl.minimum(start + partition, seq_len)
        for tile in range(tl.maximum(start, first // TILE * TILE), end, TILE):  # tiles wholly before the window skipped
            pos = tile + tl.arange(0, TILE)
            valid = (pos < end) & (pos >= first)
            if PRODUCTS:
                offs = tile_rows(tables_ptr, seq, stride_bt, stride_kb, stride_kt, stride_kh, kv_head, pos, valid,
                                 BLOCK_SIZE)
                k, k_scale = load_code_tile(k_ptr, offs, d, valid, DIM, CODE)
                v, v_scale = load_code_tile(v_ptr, offs, d, valid, DIM, CODE)
                scores = code_scores(q_codes, q_back, k, k_scale, scale)
            else:
                k, k_scale, v, v_scale = load_kv_tile(k_ptr, v_ptr, tables_ptr, seq, stride_bt, stride_kb, stride_kt,
                                                      stride_kh, kv_head, pos, valid, d, DIM, BLOCK_SIZE, CODE, MANT, BIAS)
                scores = tile_scores(q, k, k_scale, scale, F32)  # [ROWS, TILE]
            if SOFTCAP:  # compiled in only for the models that cap their scores
                scores = capped(scores, softcap)
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            if PRODUCTS:
                acc = acc * alpha[:, None] + code_weighted(p, v, v_scale, CODE, INTERPRETED)
            else:
                acc = acc * alpha[:, None] + tile_weighted(p, v, v_scale, q.dtype, F32)
            m = m_new
        row = (seq * tl.num_programs(1) * GROUP + heads) * max_splits + split
        tl.store(part_max_ptr + row, m, mask=g < GROUP)
        tl.store(part_sum_ptr + row, l, mask=g < GROUP)
        tl.store(part_out_ptr + row[:, None] * DIM + d[None, :], acc, mask=(g[:, None] < GROUP) & (d[None, :] < DIM))


@triton.jit
def _first_key(seq_len, window):
    """The first position a decode query sees: 0, or the start of its sliding window."""
    return tl.where((window > 0) & (seq_len > window), seq_len - window, 0)


@triton.jit(do_not_specialize=["max_splits", "partition"])
def _decode_reduce(
    part_out_ptr, part_max_ptr, part_sum_ptr, lens_ptr, out_ptr, stride_os, stride_oh, num_heads, max_splits,
    partition, window, DIM: tl.constexpr, DIM_PAD: tl.constexpr, CHUNK: tl.constexpr,
):
    """One query head's output from its slices' partials, ``CHUNK`` slices at a time (an online
    softmax over the slices: any count of them, one compiled variant)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(lens_ptr + seq)
    num_splits = tl.cdiv(seq_len, partition)
    first = _first_key(seq_len, window) // partition  # slices before the window wrote nothing
    d = tl.arange(0, DIM_PAD)
    top = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([DIM_PAD], tl.float32)
    for chunk in range(first, num_splits, CHUNK):
        s = chunk + tl.arange(0, CHUNK)
        row = (seq * num_heads + head) * max_splits + s
        live = s < num_splits
        m = tl.load(part_max_ptr + row, mask=live, other=float("-inf"))
        l = tl.load(part_sum_ptr + row, mask=live, other=0.0)
        o = tl.load(part_out_ptr + row[:, None] * DIM + d[None, :], mask=live[:, None] & (d[None, :] < DIM), other=0.0)
        new_top = tl.maximum(top, tl.max(m, axis=0))  # each chunk's first slice is live: finite
        w = tl.where(live, tl.exp(m - new_top), 0.0)
        kept = tl.exp(top - new_top)
        total = total * kept + tl.sum(l * w, axis=0)
        acc = acc * kept + tl.sum(o * w[:, None], axis=0)
        top = new_top
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d, (acc / total).to(out_ptr.dtype.element_ty), mask=d < DIM)


def paged_attention_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, max_seq_len: int | None = None, window: int = 0, softcap: float = 0.0,
    kv_format: KVFormat = AUTO, partition: int | None = None,
) -> torch.Tensor:
    """Same contract as ``kernels.reference.paged_attention_decode``; ``partition``: context tokens
    per program (a multiple of the key tile), None: ``decode_partition``'s for this launch."""
    check_cache(k_cache, v_cache, kv_format)
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q must be [num_seqs, num_heads, head_dim] with unit last stride, got {tuple(q.shape)}")
    group = check_heads(q, k_cache, kv_format)
    check_tables(block_tables, seq_lens, q.shape[0])
    check_same(q.device, k_cache.device, block_tables.device, seq_lens.device)
    num_seqs, num_heads, dim = q.shape
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    max_len = max_seq_len if max_seq_len is not None else int(seq_lens.max())
    if partition is None:
        partition = decode_partition(num_seqs, k_cache.shape[2], max_len)
    splits = decode_splits(max_len, partition)  # decode_scratch_bytes counts the three buffers below
    part_out = torch.empty((num_seqs, num_heads, splits, dim), dtype=torch.float32, device=q.device)
    part_max = torch.empty((num_seqs, num_heads, splits), dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    block_tables = block_tables.contiguous()
    rows, dim_pad = dot_pad(group), dot_pad(dim)
    _decode_partial[(num_seqs, k_cache.shape[2], splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_max, part_sum, scale,
        q.stride(0), q.stride(1), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        splits, partition, window, float(softcap), GROUP=group, ROWS=rows, DIM=dim,
        DIM_PAD=dim_pad, BLOCK_SIZE=k_cache.shape[1], TILE=decode_tile(dim, kv_format.quantized_products),
        F32=dot_in_float32(q.dtype), SOFTCAP=softcap > 0.0, **code_constants(kv_format, q.device),
        PRODUCTS=kv_format.quantized_products, INTERPRETED=interpreted(), num_warps=NUM_WARPS,
    )
    _decode_reduce[(num_seqs, num_heads)](
        part_out, part_max, part_sum, seq_lens, out, out.stride(0), out.stride(1), num_heads, splits, partition, window,
        DIM=dim, DIM_PAD=triton.next_power_of_2(dim), CHUNK=REDUCE_CHUNK,
    )
    return out
