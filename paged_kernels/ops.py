"""The kernel-ops contract and the choice of backend: Triton kernels or their torch references.

``AttentionOps`` is what a model layer calls (paged attention, K/V stores, block copies and the
mixture-of-experts feed-forward); ``select_ops`` returns the Triton kernels on CUDA
(or wherever ``backend="triton"`` is asked, e.g. under ``TRITON_INTERPRET=1`` in tests), the C
kernels compiled for this CPU elsewhere (``native``), and the torch references where those cannot
be built. Nothing above this file knows which one runs.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import structlog
import torch

from pagedserve.kernels import reference
from pagedserve.kernels.backends import BACKENDS
from pagedserve.kernels.checks import check_products
from pagedserve.kernels.kv_format import AUTO, KVFormat
from pagedserve.kernels.moe_reference import grouped_moe
from pagedserve.kernels.native_attention import NativeAttention
from pagedserve.kernels.native_build import NativeKernelUnavailable
from pagedserve.kernels.native_layer_ops import NativeLayerOps

log = structlog.get_logger("pagedserve.kernels")


@dataclass(frozen=True)
class AttentionOps:
    store_kv: Callable
    decode: Callable
    prefill: Callable
    copy_blocks: Callable
    swap_blocks: Callable
    moe: Callable = grouped_moe  # (x, gate_up, down, top_index, top_weight) -> [T, H]
    backend: str = "torch"  # "triton" kernels can be captured in CUDA graphs; the reference cannot
    kv_format: KVFormat = AUTO  # how store_kv writes the cache and the attention ops read it
    layer: NativeLayerOps | None = None  # a layer's norms, rotary + K/V store and SiLU in C (CPU), else torch
    lora: Callable | None = None  # (y, x, A, B, slots) -> y: LoRA updates per row (Triton); None: worker/runner/lora's grouped products


def select_ops(device: torch.device, backend: str = "auto", kernel_cache: Path | None = None,
               kv_format: KVFormat = AUTO) -> AttentionOps:
    """``auto``: Triton kernels on CUDA when triton imports (a warning and the torch references
    when it does not), the native C kernels on the CPU when they build (a warning and the torch
    references when they do not); ``triton`` and ``native`` fail clearly where they cannot run.
    ``kernel_cache``: where the C kernels are built (default: a ``pagedserve-kernels`` folder in
    the system's temporary directory)."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if backend == "triton" or (backend == "auto" and device.type == "cuda"):
        check_products(kv_format, device)
        try:
            return triton_ops(kv_format)
        except ImportError as err:
            if backend == "triton":
                raise ValueError(f"attention backend 'triton' needs the triton package: {err}") from err
            log.warning("triton unavailable: using the torch attention reference", device=str(device), error=str(err))
    elif backend == "native" or (backend == "auto" and device.type == "cpu"):
        if kv_format.quantized_products:
            raise ValueError("quantized products run on the Triton kernels (a CUDA GPU) or the torch reference "
                             "(--attention-backend torch); this CPU's C kernels decode the codes")
        try:
            return native_ops(kernel_cache or Path(tempfile.gettempdir()) / "pagedserve-kernels", kv_format)
        except NativeKernelUnavailable as err:
            if backend == "native":
                raise ValueError(f"attention backend 'native' cannot be built here: {err}") from err
            log.warning("native CPU kernels unavailable: using the torch attention reference", error=str(err))
    return reference_ops(kv_format)


def reference_ops(kv_format: KVFormat = AUTO) -> AttentionOps:
    """The torch references, with their own gather workspace (layers run one after another)."""
    workspace = reference.Workspace()
    return AttentionOps(
        partial(reference.store_kv, kv_format=kv_format),
        partial(reference.paged_attention_decode, workspace=workspace, kv_format=kv_format),
        partial(reference.prefill_attention, workspace=workspace, kv_format=kv_format), reference.copy_blocks,
        reference.swap_blocks, kv_format=kv_format,
    )


def native_ops(kernel_cache: Path, kv_format: KVFormat = AUTO) -> AttentionOps:
    """The C attention and layer kernels for this CPU (built into ``kernel_cache`` on first use); K/V
    stores (where the layer kernels do not make them with the rotary) and block copies stay the
    torch ones, which are single index copies already, and the mixture-of-experts block the
    grouped torch loop."""
    attention = NativeAttention(kernel_cache, kv_format)
    log.info("CPU attention kernels", prefill=attention.prefill_kind)
    return AttentionOps(partial(reference.store_kv, kv_format=kv_format), attention.decode, attention.prefill,
                        reference.copy_blocks, reference.swap_blocks, backend="native", kv_format=kv_format,
                        layer=NativeLayerOps(attention.lib))


def triton_ops(kv_format: KVFormat = AUTO) -> AttentionOps:
    """The Triton kernels, imported here: triton is absent on many CPU machines."""
    from pagedserve.kernels.copy_blocks import copy_blocks, swap_blocks
    from pagedserve.kernels.fused_moe import fused_moe
    from pagedserve.kernels.lora_update import lora_update
    from pagedserve.kernels.paged_attention import paged_attention_decode
    from pagedserve.kernels.prefill_attention import prefill_attention
    from pagedserve.kernels.store_kv import store_kv

    return AttentionOps(partial(store_kv, kv_format=kv_format), partial(paged_attention_decode, kv_format=kv_format),
                        partial(prefill_attention, kv_format=kv_format), copy_blocks, swap_blocks, fused_moe, "triton",
                        kv_format, lora=lora_update)
