"""Triton: scatter the step's new K/V into their cache slots (slot < 0: skipped).

One program per token copies its ``num_kv_heads * head_dim`` values for K and for V; a quantized
cache gets the rows ``kv_format.quantize`` makes (torch ops, the reference's own, so both backends
write the same bytes and capture in a CUDA graph alike). Offsets are int64: a large pool has more than 2**31 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.checks import check_cache, check_same
from pagedserve.kernels.kv_format import AUTO, KVFormat


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    key_stride, value_stride,
    ROW: tl.constexpr, ROW_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, ROW_PAD)
        mask = offs < ROW
        k = tl.load(key_ptr + token * key_stride + offs, mask=mask)
        v = tl.load(value_ptr + token * value_stride + offs, mask=mask)
        tl.store(k_cache_ptr + slot * ROW + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + slot * ROW + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_format: KVFormat = AUTO,
) -> None:
    """Same contract as ``kernels.reference.store_kv``."""
    check_cache(k_cache, v_cache, kv_format)
    heads, dim = k_cache.shape[2], kv_format.head_dim(k_cache)
    if key.dim() != 3 or key.shape[1:] != (heads, dim) or value.shape != key.shape:
        raise ValueError(f"key/value must be [num_tokens, {heads}, {dim}], got {tuple(key.shape)}, {tuple(value.shape)}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    check_same(key.device, k_cache.device, slot_mapping.device)
    if key.shape[0] == 0:
        return
    if kv_format.quantized:
        key, value = kv_format.quantize_pair(key, value)
    key = key.reshape(key.shape[0], -1).contiguous()
    value = value.reshape(value.shape[0], -1).contiguous()
    row = key.shape[1]
    _store_kv_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
        ROW=row, ROW_PAD=triton.next_power_of_2(row),
    )
