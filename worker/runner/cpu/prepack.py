"""Linear layers on the CPU in the form this CPU runs fastest.

float32 and bfloat16, where the C kernels build: our own kernel (``PanelLinear``,
``csrc/float_linear.c``), the weight laid out in panels of 32 output channels per input, each
output's sum in its own vector lane over its inputs in order (bfloat16 weights widened exactly,
float32 sums, the output rounded once), lines asked of memory ahead: one float32 row streams the
weights at ~70 GB/s where oneDNN's GEMV reached ~40-50 (SmolLM2's 121 matrices at one row 7.6
against 10.4-14.0 ms on a 2-core EPYC), and a tile of eight rows shares each line, so batches are
not slower either (64 rows 39.8 against 47.5 ms). Its sums depend neither on the batch (a row alone
or in any batch: the same bits) nor on the instruction set, and bfloat16 needs no bf16 instructions
and no float32 copy. Elsewhere, float32 and, with bf16 matrix instructions (AVX-512 BF16, AMX, AVX-NE-CONVERT), bfloat16: the
weights reordered once for oneDNN (``PrepackedLinear``). ``F.linear`` streams a plain weight
through MKL's GEMV at one row, or lets oneDNN reorder a bf16 weight on every call; the stored
blocked layout runs the same oneDNN kernel without either (measured on a 2-core AVX-512 EPYC, one
stream of SmolLM2-135M in float32: 24.0 -> 43.2 tokens/s; its 49,152 x 576 head at one row 7.0 ->
2.1 ms; bf16 768 -> 2560: 0.139 -> 0.056 ms at 1 row). float32 sums then run in oneDNN's order,
not MKL's: greedy parity with transformers still holds on every family and the real model.

Without bf16 instructions a bf16 GEMM is emulated: on an AVX2-only CPU six times slower than
float32 (768 -> 2560 at 64 rows: 14.4 ms against 2.4 ms), and oneDNN *accepts* the bf16 reorder on
AVX-512 without BF16 and then runs it emulated (bf16 measured 0.44x float32 there). So the choice
reads the CPU's flags (``bf16_in_hardware``), not what oneDNN accepts; without them the weights are
kept widened to float32 (``WidenedLinear``) and the layer computes in float32 from bf16 inputs,
rounding its output to bf16: the same products (bf16 values are exact in float32) summed in
float32, as a bf16 GEMM sums them, for twice the weight memory.

oneDNN (through ideep) keeps a primitive, about half a megabyte, for every input shape it meets, up
to 1,024 of them per process: a serving worker meets every row count from 1 to
``--max-num-batched-tokens``, so its memory grew for as long as new prefill chunk lengths came
(the soak: +3-4 MB/min after half an hour, 2.3 GB and rising). ``PrepackedLinear`` therefore runs
its GEMM at one of a few row counts (``gemm_rows``: exact up to 16, then eight sizes per doubling,
at most 12.5% padding rows), so the shapes, and the memory, are bounded.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pagedserve.kernels.native_layer_ops import NativeLayerOps

BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "avx_ne_convert"})  # /proc/cpuinfo names of bf16 matrix instructions


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``'s first ``flags`` line; empty where there is none)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                cpuinfo = f.read()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def bf16_in_hardware(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU multiplies bf16 in hardware (``BF16_FLAGS``), so bf16 GEMMs are not emulated."""
    return bool((cpu_flags() if flags is None else flags) & BF16_FLAGS)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """float32 or bf16 on a CPU whose oneDNN takes the weight reorder (tried once on a tiny weight:
    an AVX2-only CPU refuses the bf16 one). Taken is not fast: see ``fast_cpu_linears``."""
    if not (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype, device=device), 1)
    except RuntimeError:
        return False
    return True


EXACT_ROWS = 16  # GEMMs of up to this many rows (decode batches) run at their own row count
SIZES_PER_DOUBLING = 8  # above it, row counts are rounded up to one of this many sizes per doubling


def gemm_rows(rows: int) -> int:
    """The row count a GEMM of ``rows`` rows runs at: ``rows`` up to ``EXACT_ROWS``, above that
    rounded up to a multiple of 1/``SIZES_PER_DOUBLING`` of the power of two below it (17 -> 18,
    100 -> 104, 2049 -> 2304), so a layer meets ~8 shapes per doubling and pads < 12.5%."""
    if rows <= EXACT_ROWS:
        return rows
    step = max(1, (1 << (rows.bit_length() - 1)) // SIZES_PER_DOUBLING)
    return -(-rows // step) * step


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
        rows = x.reshape(-1, shape[-1])
        padding = gemm_rows(rows.shape[0]) - rows.shape[0]
        if padding:  # zero rows, so oneDNN meets a bounded set of shapes (module docstring)
            rows = F.pad(rows, (0, 0, 0, padding))
        out = self.gemm(rows)
        return out[:out.shape[0] - padding].view(*shape[:-1], self.out_features)

    def gemm(self, rows: torch.Tensor) -> torch.Tensor:
        """oneDNN's GEMM of ``rows`` ``[gemm_rows(n), in]`` by the stored weight."""
        return torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")


class PanelLinear(nn.Module):
    """``nn.Linear`` (float32 or bfloat16) on the C kernel (``csrc/float_linear.c``), the weight in
    its panels at the layer's dtype."""

    def __init__(self, linear: nn.Linear, kernels: NativeLayerOps) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernels = kernels
        self.weight = nn.Parameter(kernels.float_panels(linear.weight.detach()), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = self.kernels.float_linear(x.reshape(-1, shape[-1]).contiguous(), self.weight, self.out_features, self.bias)
        if out is None:
            raise ValueError(f"a {self.weight.dtype} layer on the C kernel cannot take a {x.dtype} input on {x.device}")
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


def fast_cpu_linears(model: nn.Module, device: torch.device, dtype: torch.dtype,
                     flags: frozenset[str] | None = None, kernels: NativeLayerOps | None = None) -> str | None:
    """Give a float32 or bf16 model on the CPU the linear layers this CPU runs fastest:
    ``"panels"`` (the C kernel, where ``kernels`` are given), else ``"prepacked"``, ``"widened"``
    (bf16 without bf16 instructions), or None (left as they are). ``flags``: the CPU's (default:
    read from ``/proc/cpuinfo``)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    if kernels is not None:
        _replace_linears(model, lambda linear: PanelLinear(linear, kernels))
        return "panels"
    if dtype == torch.bfloat16 and not bf16_in_hardware(flags):
        widen_linears(model)
        return "widened"
    if can_prepack(device, dtype):
        prepack_linears(model)
        return "prepacked"
    return None


def _replace_linears(model: nn.Module, make) -> int:
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, make(child))
                replaced += 1
    return replaced
