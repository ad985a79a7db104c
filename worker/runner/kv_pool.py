"""The layout of a model's paged KV pool: K and V of every layer in one tensor
``[2 * layers, num_blocks, block_size, kv_heads, row width]``, so block copies and swaps are one
operation, and the per-layer (K, V) views the attention reads. The target's pool, its CPU swap
pool and a draft model's pool (drafter.py) are all laid out so."""

from __future__ import annotations

import torch

from pagedserve.kernels.kv_format import KVFormat
from pagedserve.worker.runner.models.layers import CausalLM


def pool_shape(model: CausalLM, num_blocks: int, block_size: int, kv: KVFormat) -> tuple[int, ...]:
    return 2 * len(model.model.layers), num_blocks, block_size, model.num_kv_heads, kv.row_width(model.head_dim)


def layer_caches(pool: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) views of ``pool``."""
    return [(pool[2 * i], pool[2 * i + 1]) for i in range(pool.shape[0] // 2)]
