"""Argument checks shared by the kernel launchers: a wrong shape, dtype or device is a clear
error before launch, not a silent out-of-bounds read inside a kernel."""

from __future__ import annotations

import torch

from pagedserve.kernels.kv_format import AUTO, KVFormat

CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_format: KVFormat = AUTO) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"caches must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    allowed = (torch.uint8,) if kv_format.quantized else CACHE_DTYPES
    if k_cache.dtype not in allowed or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"a kv_cache_dtype {kv_format.name} cache's dtype must be one of {allowed}, the same for K and V; "
                         f"got {k_cache.dtype} and {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("caches must be contiguous")
    block_size = k_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two for the Triton kernels, got {block_size}")


def check_same(*devices: torch.device) -> None:
    if len({str(d) for d in devices}) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted({str(d) for d in devices})}")


def check_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_seqs: int) -> None:
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be int32 [{num_seqs}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}")
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be int32 [{num_seqs}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")


def check_heads(q: torch.Tensor, k_cache: torch.Tensor, kv_format: KVFormat = AUTO) -> int:
    """The GQA group size (query heads per KV head)."""
    heads, kv_heads, dim = q.shape[-2], k_cache.shape[2], kv_format.head_dim(k_cache)
    if q.shape[-1] != dim:
        raise ValueError(f"q head_dim {q.shape[-1]} != cache head_dim {dim}")
    if heads % kv_heads:
        raise ValueError(f"num_heads {heads} is not a multiple of num_kv_heads {kv_heads}")
    if dim not in (16, 32, 64, 80, 96, 128, 256):
        raise ValueError(f"head_dim {dim} is not supported (16, 32, 64, 80, 96, 128, 256)")
    return heads // kv_heads


def check_products(kv_format: KVFormat, device: torch.device) -> None:
    """Quantized products (``paged_kernels/quantized_products.py``) need a GPU that multiplies the
    cache's codes: int8 from sm_80 (Ampere), e4m3 from sm_89 (Ada, Hopper). Checked once, when the
    Triton ops are chosen (``ops.select_ops``), not on every launch."""
    if not kv_format.quantized_products or device.type != "cuda":
        return
    needs = (8, 0) if kv_format.code == torch.int8 else (8, 9)
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < needs:
        raise ValueError(f"quantized products over a {kv_format.name} cache need sm_{needs[0]}{needs[1]} or newer; "
                         f"{device} is sm_{major}{minor}")
