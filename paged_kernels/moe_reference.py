"""Mixture-of-experts feed-forward in torch: the CPU path and the reference the Triton kernel
(``paged_kernels/fused_moe.py``) is tested against.

Each expert that received tokens runs once on all of them (one gather, two matmuls, one
``index_add_``), so the work is proportional to the tokens routed, not to tokens x experts. The
per-expert token counts are read on the host, which a CUDA graph cannot capture; on CUDA the fused
kernel runs instead.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def grouped_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_index: torch.Tensor,
                top_weight: torch.Tensor) -> torch.Tensor:
    """x ``[T, H]``; gate_up ``[E, 2I, H]`` (gate rows first), down ``[E, H, I]``; top_index and
    top_weight ``[T, K]`` -> ``sum_k weight[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))``, ``[T, H]``."""
    out = torch.zeros_like(x)
    flat_expert = top_index.reshape(-1)
    order = flat_expert.argsort(stable=True)  # the (token, slot) pairs grouped by expert
    counts = torch.bincount(flat_expert, minlength=gate_up.shape[0]).tolist()
    tokens = order // top_index.shape[1]
    weights = top_weight.reshape(-1)[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start : start + count]
        gate, up = F.linear(x[rows], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, rows, y * weights[start : start + count, None].to(y.dtype))
        start += count
    return out
