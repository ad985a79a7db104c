"""The forms a loaded model's layers take on the CPU before serving: q/k/v and gate/up fused into one
matrix each (``fuse_projections``), and the C layer kernels handed to the modules that can use them
(``use_layer_kernels``); the loader applies both a decoder layer at a time (``runner/loader.py``)."""

from __future__ import annotations

from torch import nn
from torch.nn import functional as F

from pagedserve.kernels.native_layer_ops import NativeLayerOps
from pagedserve.worker.runner.models.layers import MLP, Attention, RMSNorm


def fuse_projections(model: nn.Module) -> int:
    """Give every attention block one q/k/v matrix and every dense feed-forward one gate/up matrix
    (those not fused already): fewer, wider matrix calls per layer (on the CPU a call's fixed cost is
    a tenth of a small layer's time). How many blocks were fused."""
    blocks = [m for m in model.modules() if isinstance(m, (Attention, MLP)) and not m.fused]
    for block in blocks:
        block.fuse_projections()
    return len(blocks)


def use_layer_kernels(model: nn.Module, kernels: NativeLayerOps | None) -> int:
    """Hand the C layer kernels (``AttentionOps.layer``; None: nothing to hand) to every plain
    RMSNorm, SiLU-gated MLP and attention block whose q, k and v need only the rotary (after
    ``fuse_projections``): a layer's small operations one C call each. How many modules took them."""
    if kernels is None:
        return 0
    taking = [m for m in model.modules() if type(m) is RMSNorm or (type(m) is MLP and m.act is F.silu)
              or (isinstance(m, Attention) and m.plain)]
    for module in taking:
        module.kernels = kernels
    return len(taking)
