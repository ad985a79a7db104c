"""Paged attention behind one interface: the model calls ``PagedAttention``, which stores the step's
K/V into the cache slots and attends through block tables. On CUDA it uses the Triton kernels
(when they import), elsewhere the torch references. Nothing above this file knows which.

The batch is ordered decodes first (one token each), then prefill chunks; ``AttentionMetadata``
describes both parts and is passed explicitly into every layer (no global forward context).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from kernels import reference


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    num_decodes: int  # the first num_decodes tokens are single-token decodes, one per sequence
    decode_block_tables: torch.Tensor  # int32 [num_decodes, max_blocks]
    decode_seq_lens: torch.Tensor  # int32 [num_decodes]
    prefill_block_tables: torch.Tensor  # int32 [num_prefills, max_blocks]
    prefill_seq_lens: torch.Tensor  # int32 [num_prefills], context including the chunk
    prefill_query_start: torch.Tensor  # int32 [num_prefills + 1], offsets relative to the prefill part


@dataclass(frozen=True)
class AttentionOps:
    store_kv: Callable
    decode: Callable
    prefill: Callable
    copy_blocks: Callable
    swap_blocks: Callable


def select_ops(device: torch.device, backend: str = "auto") -> AttentionOps:
    """``auto``: Triton kernels on CUDA, torch references elsewhere. ``triton`` on a CPU needs
    ``TRITON_INTERPRET=1`` (tests use it). Each call gets its own workspace."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"attention backend must be auto, torch or triton; got {backend!r}")
    if backend == "triton" or (backend == "auto" and device.type == "cuda"):
        from kernels import triton_ops  # imported lazily: triton is absent on many CPU machines

        return triton_ops.make_ops()
    workspace = reference.Workspace()  # one per runner: layers run one after another
    return AttentionOps(
        reference.store_kv, partial(reference.paged_attention_decode, workspace=workspace),
        partial(reference.prefill_attention, workspace=workspace), reference.copy_blocks, reference.swap_blocks,
    )


class PagedAttention:
    """Attention of one layer over its paged K/V cache."""

    def __init__(self, ops: AttentionOps, scale: float) -> None:
        self.ops = ops
        self.scale = scale

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]``."""
        k_cache, v_cache = kv_cache
        self.ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        d = meta.num_decodes
        parts = []
        if d:
            parts.append(self.ops.decode(q[:d], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale))
        if q.shape[0] > d:
            parts.append(self.ops.prefill(
                q[d:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start,
                meta.prefill_seq_lens, self.scale,
            ))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
