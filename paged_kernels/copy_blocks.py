"""Triton: copy-on-write block copies for every layer in one launch; swaps between pools.

The KV pool is one tensor ``[2 * num_layers, num_blocks, block_size, num_kv_heads, head_dim]``, so
a copy of block ``src`` to ``dst`` is the same offsets in every layer plane: grid
``(num_pairs, 2 * num_layers)``, each program moving one block of one plane in chunks.
Swaps cross the PCIe bus between the device and a pinned CPU pool, which a kernel cannot
reach; they are a gather on the source device and one transfer (``swap_blocks``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.reference import swap_blocks  # noqa: F401  (re-exported: the swap path is plain torch)

CHUNK = 1024


@triton.jit
def _copy_blocks_kernel(pool_ptr, pairs_ptr, plane_stride, block_stride, BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr):
    pair = tl.program_id(0).to(tl.int64)
    plane = tl.program_id(1).to(tl.int64)
    src = tl.load(pairs_ptr + pair * 2).to(tl.int64)
    dst = tl.load(pairs_ptr + pair * 2 + 1).to(tl.int64)
    base = pool_ptr + plane * plane_stride
    for start in range(0, BLOCK_NUMEL, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < BLOCK_NUMEL
        tl.store(base + dst * block_stride + offs, tl.load(base + src * block_stride + offs, mask=mask), mask=mask)


def copy_blocks(kv_pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """Same contract as ``kernels.reference.copy_blocks``."""
    if kv_pool.dim() != 5 or not kv_pool.is_contiguous():
        raise ValueError("kv_pool must be a contiguous [2 * layers, num_blocks, block_size, kv_heads, head_dim] tensor")
    if pairs.dim() != 2 or pairs.shape[1] != 2:
        raise ValueError(f"pairs must be [N, 2], got {tuple(pairs.shape)}")
    if pairs.numel() == 0:
        return
    pairs = pairs.to(device=kv_pool.device, dtype=torch.int64).contiguous()
    block_numel = kv_pool[0, 0].numel()
    _copy_blocks_kernel[(pairs.shape[0], kv_pool.shape[0])](
        kv_pool, pairs, kv_pool.stride(0), kv_pool.stride(1), BLOCK_NUMEL=block_numel, CHUNK=min(CHUNK, triton.next_power_of_2(block_numel)),
    )
