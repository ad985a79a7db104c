"""bf16 linear layers on the CPU, in the form this CPU runs fastest.

With bf16 matrix instructions (AVX-512 BF16/AMX, or AVX-NE-CONVERT): the weights reordered once
for oneDNN. ``F.linear`` on a plain bf16 weight lets oneDNN reorder the weight into its blocked
layout on every call; done once at load, the same kernel runs on the stored layout: bit-identical
results, and faster (measured on a 2-core AVX-512 AMD EPYC, 768 -> 2560: 0.139 -> 0.056 ms at 1
row, 0.719 -> 0.615 ms at 64, 20.0 -> 19.2 ms at 2048). Only bf16: in float32 the prepacked kernel
is a different one whose sums differ in the last bits, which would move greedy parity.

Without them (an AVX2-only CPU) a bf16 GEMM is emulated and six times slower than float32 (768 ->
2560 at 64 rows: 14.4 ms against 2.4 ms, on a 2-core AVX2 AMD EPYC). There the weights are kept
widened to float32 and the layer computes in float32 from bf16 inputs, rounding its output to bf16:
the same products (bf16 values are exact in float32) summed in float32, as a bf16 GEMM sums them,
for twice the weight memory.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """bf16 on a CPU whose oneDNN has a bf16 linear kernel (AVX-512 or AVX-NE-CONVERT: an AVX2-only
    CPU refuses the reorder, so it is tried once on a tiny weight rather than guessed)."""
    if not (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype, device=device), 1)
    except RuntimeError:
        return False
    return True


class PrepackedLinear(nn.Module):
    """``nn.Linear`` whose weight is kept in oneDNN's layout (``[out, in]`` shape, reordered bytes)."""

    def __init__(self, linear: nn.Linear, rows_hint: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.weight, self.bias, "none", [], "")
        return out.view(*shape[:-1], self.out_features)


class WidenedLinear(nn.Module):
    """``nn.Linear`` for bf16 activations with float32 weights and arithmetic (no bf16 hardware)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().float(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight, self.bias).to(x.dtype)


def prepack_linears(model: nn.Module, rows_hint: int = 64) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PrepackedLinear``; how many were replaced."""
    return _replace_linears(model, lambda linear: PrepackedLinear(linear, rows_hint))


def widen_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``WidenedLinear``; how many were replaced."""
    return _replace_linears(model, WidenedLinear)


def fast_cpu_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> str | None:
    """Give a bf16 model on the CPU the linear layers this CPU runs fastest: ``"prepacked"``,
    ``"widened"``, or None (anything else is left as it is)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    if can_prepack(device, dtype):
        prepack_linears(model)
        return "prepacked"
    widen_linears(model)
    return "widened"


def _replace_linears(model: nn.Module, make) -> int:
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, make(child))
                replaced += 1
    return replaced
