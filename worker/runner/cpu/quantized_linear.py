"""Weight-only quantized linear layers (``--quantization int8|int4``), executed quantized by
torch's own CPU kernels: ``_weight_int8pack_mm`` (int8 weights, one scale per output channel) and
``_weight_int4pack_mm_for_cpu`` (int4 weights in groups of 32 along the input, a scale and a zero
per group, tinygemm's convention ``w = (q - 8) * scale + zero``).

Both kernels are fast only with bfloat16 activations (measured on a 2-core AVX-512 EPYC, 576 ->
1,536 at one row: float32 ``F.linear`` 48 us, int8 16 us and int4 19 us from bfloat16, but 285 and
648 us from float32), so a layer computes from its input rounded to bfloat16 and returns its
model's dtype. Scales are rounded to bfloat16 before the codes are taken, so the stored grid is the
one the kernel multiplies by. Where the C kernels build (the engine's CPU ops), an int8 layer runs
ours instead (``paged_kernels/csrc/int8_linear.c``): its input at int16 per group of 256, integer
sums exact, no bfloat16 rounding of input or output (a hundred times closer to the grid's exact
product), the same result for a row alone or in a batch, and at one row twice torch's speed.
Groups of 32 are GGUF's Q4_0/Q4_1 blocks: a Q4_1 file's dequantized weights fall back on exactly
their own grid.

A layer whose input width is not a multiple of the group (or output width of 16, the int4 kernel's
tile) stays at the model's dtype under int4. ``lm_head`` is int8 under int4 too, as llama.cpp's Q4
files keep their output matrix at 8 bits (SmolLM2's Q4_1 file: Q8_0; int4 everywhere measured
+6.7% perplexity there, +1.1% with an int8 head). Embedding tables are int8 with a scale per 32
values of a row (``Int8Embedding``; a looked-up row is decoded), as GGUF's Q8_0 stores them; a tied
``lm_head`` gets its own int8 copy (per output channel, as its kernel needs), so a small model's
largest matrix costs two bytes per weight instead of four (SmolLM2: one scale per row for the
embedding too measured +0.81% perplexity for int8 against +0.29%).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.backends import QUANTIZATIONS
from pagedserve.kernels.native_layer_ops import NativeLayerOps

GROUP = 32  # int4: weights per scale and zero, along the input
COMPUTE = torch.bfloat16  # the kernels' activation dtype
CHUNK_ELEMENTS = 1 << 21  # values quantized at a time: float32 temporaries of at most 8 MiB


class Int8Linear(nn.Module):
    """``nn.Linear`` with int8 weights and a bfloat16 scale per output channel; ``kernels``: the C
    kernel runs it (``csrc/int8_linear.c``; the codes kept in its panel layout), else torch's from
    bfloat16 (the codes ``[out, in]``)."""

    def __init__(self, linear: nn.Linear, kernels: NativeLayerOps | None = None) -> None:
        super().__init__()
        self.kernels = kernels
        self.in_features, self.out_features = linear.in_features, linear.out_features
        codes, scale = _int8(linear.weight.detach(), COMPUTE)
        self.register_buffer("codes", codes if kernels is None else kernels.int8_panels(codes))
        self.register_buffer("scale", scale[:, 0])
        self.bias = _bias(linear)

    def plain_codes(self) -> torch.Tensor:
        """int8 ``[out, in]`` (the C kernel's panel layout undone where it holds them)."""
        if self.kernels is None:
            return self.codes
        return self.kernels.int8_codes(self.codes, self.out_features, self.in_features).contiguous()

    def dequantized(self) -> torch.Tensor:
        """float32 ``[out, in]``: the weight the kernel multiplies by."""
        return self.plain_codes().float() * self.scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if self.kernels is not None and (out := self.kernels.int8_linear(flat, self.codes, self.scale, self.bias)) is not None:
            return out.view(*shape[:-1], out.shape[-1])
        out = torch._weight_int8pack_mm(flat.to(COMPUTE), self.plain_codes(), self.scale)
        return _finish(out, self.bias, shape, x.dtype)


class Int8Embedding(nn.Module):
    """``nn.Embedding`` with int8 rows and a float32 scale per ``GROUP`` values of a row (per row
    where the width is not whole groups); a looked-up row is decoded at the model's dtype. float32,
    not bfloat16: a Q8_0 file's blocks (scale = absmax / 127) then come back on their own grid
    (measured on SmolLM2, int8: +0.45% perplexity with bfloat16 scales)."""

    def __init__(self, table: nn.Embedding) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = table.num_embeddings, table.embedding_dim
        self.dtype = table.weight.dtype
        group = GROUP if self.embedding_dim % GROUP == 0 else self.embedding_dim
        codes, scale = _int8(table.weight.detach().reshape(self.num_embeddings, -1, group), torch.float32)
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.codes[ids].to(self.dtype) * self.scale[ids].to(self.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)


class Int4Linear(nn.Module):
    """``nn.Linear`` with int4 weights packed for the CPU kernel and, per group of ``GROUP`` inputs
    of each output, a bfloat16 scale and zero (``scales_zeros`` ``[in / GROUP, out, 2]``)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        groups = linear.weight.detach().float().reshape(self.out_features, -1, GROUP)
        low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
        scale = ((high - low) / 15).clamp_min(2**-126).to(COMPUTE).float()
        zero = (low + 8 * scale).to(COMPUTE).float()  # w = (q - 8) * scale + zero
        codes = ((groups - zero) / scale + 8).round().clamp(0, 15).to(torch.int32).reshape(self.out_features, -1)
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes, 1))
        scales_zeros = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1).transpose(0, 1)
        self.register_buffer("scales_zeros", scales_zeros.contiguous().to(COMPUTE))
        self.bias = _bias(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).to(COMPUTE), self.packed, GROUP,
                                                self.scales_zeros)
        return _finish(out, self.bias, shape, x.dtype)


def dequantized_int4(layer: Int4Linear) -> torch.Tensor:
    """float32 ``[out, in]``: what ``layer`` multiplies by, read back through its kernel (an identity
    input), for tests and quality checks."""
    eye = torch.eye(layer.in_features, device=layer.packed.device)  # float32 in and out: no rounding of the grid
    return torch._weight_int4pack_mm_for_cpu(eye, layer.packed, GROUP, layer.scales_zeros.float()).T


def quantize_linears(model: nn.Module, quantization: str, device: torch.device,
                     kernels: NativeLayerOps | None = None) -> int:
    """Replace the ``nn.Linear`` layers of ``model`` by quantized ones; how many were replaced.
    ``none`` and ``gguf`` replace nothing; a quantization off the CPU is a clear error (no kernels there yet).
    ``kernels``: the C layer kernels, which run the int8 layers where given."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    if quantization in ("none", "gguf"):  # gguf: the file's blocks already run as stored (cpu/gguf_linear.py)
        return 0
    if device.type != "cpu":
        raise ValueError(f"--quantization {quantization} runs on the CPU so far (torch's int8/int4 CPU kernels); "
                         f"use --quantization none on {device.type}")
    replaced = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Embedding:
                setattr(parent, name, Int8Embedding(child))
                replaced += 1
                continue
            if type(child) is not nn.Linear:
                continue
            int8 = quantization == "int8" or (not parent_name and name == "lm_head")
            if int8 or (child.in_features % GROUP == 0 and child.out_features % 16 == 0):  # the int4 kernel's tiles
                setattr(parent, name, Int8Linear(child, kernels) if int8 else Int4Linear(child))
                replaced += 1
    return replaced


def _int8(values: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of ``values`` (any float dtype, taken in float32) over their last
    dimension and the scale of each row (``[..., 1]``, at ``scale_dtype``, rounded before the codes
    are taken: the grid stored is the one decoded). A few rows at a time (``CHUNK_ELEMENTS``), so a
    vocabulary-sized table is never copied whole in float32 while it is quantized."""
    codes = torch.empty(values.shape, dtype=torch.int8, device=values.device)
    scale = torch.empty((*values.shape[:-1], 1), dtype=scale_dtype, device=values.device)
    rows = max(1, CHUNK_ELEMENTS // max(1, values[0].numel()))
    for start in range(0, values.shape[0], rows):
        part = values[start:start + rows].to(torch.float32, copy=True)
        part_scale = (part.abs().amax(dim=-1, keepdim=True) / 127).clamp_min(2**-126).to(scale_dtype)
        scale[start:start + rows] = part_scale
        codes[start:start + rows] = part.div_(part_scale.float()).round_().clamp_(-127, 127)
    return codes, scale


def _bias(linear: nn.Linear) -> nn.Parameter | None:
    return None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)


def _finish(out: torch.Tensor, bias: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    out = out.to(dtype)
    if bias is not None:
        out = out + bias
    return out.view(*shape[:-1], out.shape[-1])
