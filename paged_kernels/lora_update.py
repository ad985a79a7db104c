"""Triton: the low-rank updates of a step's LoRA adapters, every row under its own adapter, in two
launches per layer whatever the mix (punica's "shrink" and "expand", one row per program):

    h[t] = x[t] @ A[slot[t]]^T          (rank-wide, float32)
    y[t] += h[t] @ B[slot[t]]^T         (in place, in y's dtype)

``A`` ``[adapters, rank, in]`` and ``B`` ``[adapters, out, rank]`` are the step's adapters stacked
(``worker/runner/lora/adapters.py``, ranks padded with zeros), ``slot[t]`` the row's adapter in that
stack, -1 for a row of the base model (its program does nothing). The CPU's path is the grouped
batched products of ``worker/runner/lora/lora_linear.py``; both are checked against a per-adapter loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 2048  # elements of A a shrink program holds at once (rank x input features): more spills registers on sm_90
BLOCK_N = 128  # output features an expand program writes
NUM_WARPS = 4


@triton.jit
def _shrink(x_ptr, a_ptr, slot_ptr, h_ptr, in_features, rank, stride_x, stride_as, stride_ar, stride_h,
            BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot >= 0:
        r = tl.arange(0, BLOCK_R)
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for start in range(0, in_features, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row * stride_x + k, mask=k < in_features, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :],
                        mask=(r[:, None] < rank) & (k[None, :] < in_features), other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
        tl.store(h_ptr + row * stride_h + r, acc, mask=r < rank)


@triton.jit
def _expand(h_ptr, b_ptr, slot_ptr, y_ptr, out_features, rank, stride_h, stride_bs, stride_bn, stride_y,
            BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot >= 0:
        r = tl.arange(0, BLOCK_R)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        h = tl.load(h_ptr + row * stride_h + r, mask=r < rank, other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + n[:, None] * stride_bn + r[None, :],
                    mask=(n[:, None] < out_features) & (r[None, :] < rank), other=0.0).to(tl.float32)
        delta = tl.sum(b * h[None, :], axis=1)
        y = tl.load(y_ptr + row * stride_y + n, mask=n < out_features, other=0.0)
        tl.store(y_ptr + row * stride_y + n, (y.to(tl.float32) + delta).to(y.dtype), mask=n < out_features)


def shrink_block_k(block_r: int) -> int:
    """Input features a shrink program reads at once for a rank tile of ``block_r``
    (``tests/kernels/test_register_budget.py``: 128 x 64 spilled 72 bytes a thread)."""
    return max(16, min(128, TILE // block_r))


def lora_update(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``y`` ``[T, out]`` plus each row's adapter update, in place (returned); ``x`` ``[T, in]``,
    ``slots`` ``[T]`` int32 (-1: no update)."""
    rows, in_features = x.shape
    adapters, rank, _ = a.shape
    out_features = y.shape[1]
    if b.shape != (adapters, out_features, rank) or a.shape[2] != in_features or slots.shape != (rows,):
        raise ValueError(f"lora_update: x {tuple(x.shape)}, y {tuple(y.shape)}, A {tuple(a.shape)}, B {tuple(b.shape)}, "
                         f"slots {tuple(slots.shape)} do not fit")
    if rows == 0:
        return y
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    h = torch.empty((rows, rank), dtype=torch.float32, device=x.device)
    block_r = max(16, triton.next_power_of_2(rank))
    _shrink[(rows,)](x, a, slots, h, in_features, rank, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
                     BLOCK_R=block_r, BLOCK_K=shrink_block_k(block_r), num_warps=NUM_WARPS)
    _expand[(rows, triton.cdiv(out_features, BLOCK_N))](h, b, slots, y, out_features, rank, h.stride(0), b.stride(0),
                                                       b.stride(1), y.stride(0), BLOCK_R=block_r, BLOCK_N=BLOCK_N,
                                                       num_warps=NUM_WARPS)
    return y
