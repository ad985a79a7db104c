"""A linear layer with the low-rank updates of the adapters in this step's batch.

The base layer (whatever form the loader gave it: panels, int8, a plain ``nn.Linear``) computes
every row; then the rows of the step's adapters are gathered into one block per adapter (padded to
the longest), go through their adapter's A and scaled B as two batched products, and the real rows
are added back: the same five calls per layer however many adapters the step mixes, never a forward
per adapter. A fused layer (q/k/v, gate/up) holds each part's update side by side: A the parts' A
stacked, B block-diagonal. Ranks are padded with zeros to the step's largest (exact: the padding
adds nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn


@dataclass
class LoraStep:
    """The current forward's adapter rows, grouped: ``gather`` the token indices of each adapter's
    block (``adapters`` blocks of ``width`` rows, a block's padding repeating its first row),
    ``valid`` the positions in that order that are real rows and ``rows`` those rows' tokens;
    ``weights`` per layer key A ``[adapters, rank, in]`` and B ``[adapters, out, rank]``. None:
    every row is the base model's. With a ``kernel`` (the Triton update on CUDA,
    ``paged_kernels/lora_update.py``) the rows are not grouped: ``slots`` gives each token's adapter
    in the stack (-1: the base model's) and one kernel call per layer does the rest."""

    gather: torch.Tensor | None = None
    valid: torch.Tensor | None = None  # None: no padding (every gathered row is real)
    rows: torch.Tensor | None = None
    adapters: int = 0
    width: int = 0
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    slots: torch.Tensor | None = None  # int32 [tokens], with a kernel
    kernel: Callable | None = None  # (y, x, A, B, slots) -> y, in place


def add_updates(y: torch.Tensor, x: torch.Tensor, key: str, step: LoraStep) -> torch.Tensor:
    """``y`` (the base layer's output for inputs ``x``) plus, on each adapter's rows, its update
    for the layer ``key``; in place."""
    pair = step.weights.get(key)  # none while every row is the base model's (cleared)
    if pair is None:
        return y
    a, b = pair
    if step.kernel is not None:
        return step.kernel(y, x, a, b, step.slots)
    blocks = x.index_select(0, step.gather).view(step.adapters, step.width, -1)
    delta = torch.bmm(torch.bmm(blocks, a.transpose(1, 2)), b.transpose(1, 2)).view(step.adapters * step.width, -1)
    return y.index_add_(0, step.rows, delta if step.valid is None else delta.index_select(0, step.valid))


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Module, key: str, step: LoraStep) -> None:
        super().__init__()
        self.base, self.key, self.step = base, key, step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_updates(self.base(x), x, self.key, self.step)


def layer_keys(layer: int) -> tuple[str, str, str, str]:
    """The keys of a layer's fused q/k/v, o, fused gate/up and down matrices."""
    return f"{layer}.qkv", f"{layer}.o_proj", f"{layer}.gate_up", f"{layer}.down_proj"
