"""The layout of a model's paged KV pool: K and V of one lane of layers in one tensor
``[2 * slots, num_blocks, block_size, kv_heads, row width]`` (``slots``: the layers of a lane,
``worker/core/kv_cache/kv_layout.py``; every layer where the model has one kind of attention), so
block copies and swaps are one operation, and the per-layer (K, V) views the attention reads: a
layer reads its row of whichever lane's blocks its table gives it. The target's pool, its CPU swap
pool and a draft model's pool (drafter.py) are all laid out so.

A pool in host memory that nothing pins is an anonymous mapping (``zeroed_pool``): its pages read as
zeros and become resident only when a block is first written, so a worker's memory follows the KV
it holds, not its budget (a 1 GiB pool on SmolLM2 was 1 GiB of RSS from the start)."""

from __future__ import annotations

import mmap

import torch

from pagedserve.kernels.kv_format import KVFormat
from pagedserve.worker.runner.models.layers import CausalLM


def pool_shape(model: CausalLM, num_blocks: int, block_size: int, kv: KVFormat) -> tuple[int, ...]:
    return 2 * model.kv_layout.slots, num_blocks, block_size, model.num_kv_heads, kv.row_width(model.head_dim)


def layer_caches(pool: torch.Tensor, model: CausalLM) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) views of ``pool``."""
    return [(pool[2 * slot], pool[2 * slot + 1]) for slot in model.kv_layout.layer_slots]


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, pinned: bool = False) -> torch.Tensor:
    """A zero-filled tensor of ``shape`` for a pool: on the CPU, unpinned and not empty, the pages of an
    anonymous mapping (zeros the kernel supplies on first touch, resident once written); else
    ``torch.zeros``."""
    device = torch.device(device)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype, device="meta").element_size()
    if device.type != "cpu" or pinned or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pinned)
    pages = mmap.mmap(-1, nbytes)  # the tensor below holds a reference to it: unmapped when the pool is freed
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)
