"""Triton: the mixture-of-experts feed-forward as two grouped matmuls over tokens sorted by expert.

Dispatch (``align_by_expert``, torch, no host sync so CUDA graphs capture it): the ``T x K``
(token, slot) pairs are sorted by expert and each expert's run padded to a multiple of
``BLOCK_M``, so every row block belongs to one expert; ``block_expert`` names it (-1: a block past
the end). Padding rows hold the pair id ``T * K``, which the kernels mask.

``_gate_up_kernel``: per row block and column tile of the intermediate width, ``x[token] @ gate_e``
and ``x[token] @ up_e`` in float32, then ``silu(gate) * up`` stored per pair. ``_down_kernel``:
that times ``down_e``, scaled by the pair's routing weight, stored per pair; the ``K`` rows of a
token are summed at the end (no atomics, so the result is deterministic). Reference:
``paged_kernels/moe_reference.grouped_moe``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.paged_tiles import interpreted

BLOCK_M = 16


@triton.jit
def _dot(a, b, FP32: tl.constexpr):
    """``a @ b`` accumulated in float32: on float32 inputs (and in the interpreter, whose numpy has
    no bfloat16 matmul) exactly, else on the tensor cores in the inputs' own dtype."""
    if FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, out_dtype=tl.float32)


def align_by_expert(top_index: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_pairs, block_expert)``: pair ids grouped by expert, each expert's run padded to
    ``block_m`` (padding = ``T * K``), and each row block's expert (-1 past the last run). Sizes
    are the worst case, ``T * K + E * (block_m - 1)`` rounded up, so nothing is read back."""
    device = top_index.device
    pairs = top_index.numel()
    flat = top_index.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = flat.argsort(stable=True)
    sorted_expert = flat[order]
    first_of_expert = counts.cumsum(0) - counts  # where each expert's run starts among the sorted pairs
    rank = torch.arange(pairs, device=device) - first_of_expert[sorted_expert]
    capacity = triton.cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((capacity,), pairs, dtype=torch.int32, device=device)
    sorted_pairs[starts[sorted_expert] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


@triton.jit
def _tile(expert_ptr, pairs_ptr, num_pairs, width, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's row block (its expert, -1 past the last run; its pair ids, and which are
    real) and column tile (of ``width`` columns)."""
    block = tl.program_id(0)
    expert = tl.load(expert_ptr + block).to(tl.int64)
    pair = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, pair, pair < num_pairs, cols, cols < width


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, out_ptr, pairs_ptr, expert_ptr, num_pairs, top_k, hidden, inter,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32: tl.constexpr):
    expert, pair, valid, cols, col_ok = _tile(expert_ptr, pairs_ptr, num_pairs, inter, BLOCK_M, BLOCK_N)
    if expert < 0:
        return
    token = pair // top_k
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + expert * 2 * inter * hidden
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + token[:, None] * hidden + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(w_base + cols[None, :] * hidden + ks[:, None], mask=w_mask, other=0.0)
        wu = tl.load(w_base + (inter + cols[None, :]) * hidden + ks[:, None], mask=w_mask, other=0.0)
        gate += _dot(a, wg, FP32)
        up += _dot(a, wu, FP32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + pair[:, None] * inter + cols[None, :], act.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(a_ptr, w_ptr, weight_ptr, out_ptr, pairs_ptr, expert_ptr, num_pairs, hidden, inter,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32: tl.constexpr):
    expert, pair, valid, cols, col_ok = _tile(expert_ptr, pairs_ptr, num_pairs, hidden, BLOCK_M, BLOCK_N)
    if expert < 0:
        return
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + expert * hidden * inter
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(a_ptr + pair[:, None] * inter + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * inter + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += _dot(a, w, FP32)
    scale = tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + pair[:, None] * hidden + cols[None, :], (acc * scale[:, None]).to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_index: torch.Tensor,
              top_weight: torch.Tensor, block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    """Same contract as ``kernels.moe_reference.grouped_moe``."""
    tokens, top_k = top_index.shape
    num_experts, hidden, inter = down.shape
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    sorted_pairs, block_expert = align_by_expert(top_index, num_experts)
    num_pairs = tokens * top_k
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    per_pair = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    blocks = block_expert.numel()
    fp32 = x.dtype == torch.float32 or interpreted()
    _gate_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        x, gate_up, act, sorted_pairs, block_expert, num_pairs, top_k, hidden, inter,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, FP32=fp32)
    _down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        act, down, top_weight.reshape(-1).contiguous(), per_pair, sorted_pairs, block_expert, num_pairs, hidden, inter,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, FP32=fp32)
    return per_pair.view(tokens, top_k, hidden).sum(dim=1)
