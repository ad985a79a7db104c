"""A GGUF file's quantized matrices executed as stored (the weight form ``gguf``, a quantized GGUF's
default on the CPU): the file's Q4_K, Q6_K and Q8_0 blocks are kept byte for byte, one row of blocks
per output, and ``csrc/gguf_linear.c`` multiplies by them (its input at int16 per 256 values, integer
sums, one float scale per block: what gguf's dequantization of the blocks times the input gives,
within the input's int16 rounding). No dequantized copy of a weight ever exists; a layer costs the
file's bytes. With ``int8_inputs`` (``--gguf-activations int8``) the Q4_K and Q6_K parts take their input
at int8 per 256 values instead, as llama.cpp does (``csrc/gguf_x8.c``, on AVX-512 VNNI): faster rows,
perplexity ~1% from the file's reading where int16 keeps it within 0.1% (docs/engine.md).

A batch of ``DecodeScratch.gemm_rows`` rows or more (a prefill chunk) is cheaper another way: each matrix decoded
a slice at a time into a scratch buffer shared by the model's layers (``DecodeScratch``) and
multiplied by oneDNN's GEMM (AMX or AVX-512 BF16 where the CPU has them): at bf16 the decoded weight
is rounded to bf16, as transformers' bf16 reading of the file rounds it. On a CPU with AMX, a bf16
batch between the kernel's own tile size (``NativeLayerOps.gguf_tile_rows``, 12) and ``GEMM_ROWS_AMX``
never leaves the kernel: it decodes 32 output rows at a time to bf16 in the L2 cache and multiplies
them on AMX tiles (``csrc/gguf_amx.c``), the weights read and decoded once, nothing written to memory.
(The 1.5B Q4_K_M's 196 layer matrices on a 2-core Xeon with AMX, bf16, one sitting: 12 rows 148 ms row
by row against 123 on the tiles, 16 rows 227 against 125, 24 rows 313 against 162 (185 decoded and
multiplied by oneDNN), 64 rows 247 against 249, 256 rows 640 against 422; float32, whose GEMM has no
AMX: crossing at ~48 rows. On a 2-core EPYC with AVX2 only, float32: 64 rows 1,814 against 2,568, 96
rows 3,509 against 2,758; bfloat16 there is emulated, 4x slower decoded at any size.)

A fused layer (q/k/v, gate/up) keeps each part's blocks apart, since a Q4_K_M file mixes formats
within a layer (Q6_K for some v and down matrices), and each part writes its own columns of the
result. The embedding table stays in its blocks too: a looked-up row is decoded (``GgufEmbedding``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.kernels.host_memory import huge_pages_offered
from pagedserve.kernels.native_layer_ops import GGUF_KERNEL_TYPES, NativeLayerOps
from pagedserve.worker.runner.cpu.prepack import bf16_in_hardware, cpu_flags


# Rows from which a matrix is decoded and multiplied, by the CPU's instructions (measured crossings;
# a dtype absent: never, as a bf16 GEMM without bf16 instructions is emulated).
GEMM_ROWS_AVX512 = {torch.bfloat16: 24, torch.float32: 48}
GEMM_ROWS_AMX = {torch.bfloat16: 64, torch.float32: 48}  # bf16 under 64 rows: the kernel's own tiles
GEMM_ROWS_AVX2 = {torch.float32: 80}
SCRATCH_ELEMENTS = 1 << 24  # a decoded slice at most (32 MiB at bf16): a vocabulary-sized head goes in slices


class DecodeScratch:
    """The buffer a batch's GEMM decodes each matrix slice into, one per model (its layers run one at
    a time), allocated on first use; and ``gemm_rows``, from how many rows (by dtype) a batch takes
    that path on this CPU."""

    def __init__(self, gemm_rows: dict[torch.dtype, int] | None = None, kernels: NativeLayerOps | None = None) -> None:
        self.buffer: torch.Tensor | None = None
        self.gemm_rows = gemm_rows_here(kernels=kernels) if gemm_rows is None else gemm_rows

    def matrix(self, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        if self.buffer is None or self.buffer.dtype != dtype:
            self.buffer = torch.empty(SCRATCH_ELEMENTS, dtype=dtype)
        return self.buffer[:rows * width].view(rows, width)


def gemm_rows_here(flags: frozenset[str] | None = None, kernels: NativeLayerOps | None = None) -> dict[torch.dtype, int]:
    """``GEMM_ROWS_AMX`` where ``kernels`` multiply bf16 batches on AMX tiles, else ``GEMM_ROWS_AVX512``
    on a CPU with AVX-512 or bf16 instructions, else ``GEMM_ROWS_AVX2``."""
    if kernels is not None and kernels.gguf_tile_rows() > 0:
        return GEMM_ROWS_AMX
    flags = cpu_flags() if flags is None else flags
    return GEMM_ROWS_AVX512 if "avx512f" in flags or bf16_in_hardware(flags) else GEMM_ROWS_AVX2


@dataclass(frozen=True)
class GgufMatrix:
    """A quantized matrix as the file stores it: ggml's type id and its rows of blocks (uint8
    ``[rows, row bytes]``), ``width`` inputs per row."""

    gguf_type: int
    blocks: torch.Tensor
    width: int

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]


def runs_as_stored(gguf_type: int, width: int) -> bool:
    """Whether the C kernel runs this block format at this input width."""
    return gguf_type in GGUF_KERNEL_TYPES.values() and width % 256 == 0


class GgufLinear(nn.Module):
    """``nn.Linear`` whose weight is one or more ``GgufMatrix`` parts stacked along the outputs."""

    def __init__(self, parts: list[GgufMatrix], kernels: NativeLayerOps, scratch: DecodeScratch,
                 bias: torch.Tensor | None = None, int8_inputs: bool = False) -> None:
        super().__init__()
        self.scratch = scratch
        self.int8_inputs = int8_inputs  # the row kernel takes x at int8 (``--gguf-activations int8``)
        widths = {part.width for part in parts}
        if len(widths) != 1 or not all(runs_as_stored(p.gguf_type, p.width) for p in parts):
            raise ValueError(f"GGUF parts the kernel cannot run together: {[(p.gguf_type, p.width) for p in parts]}")
        self.kernels = kernels
        self.parts = parts
        self.in_features, self.out_features = parts[0].width, sum(part.rows for part in parts)
        for i, part in enumerate(parts):  # buffers: .to(), state_dict() and memory accounting see them
            self.register_buffer(f"blocks_{i}", part.blocks, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def replacing(cls, linear: nn.Linear, part: GgufMatrix, kernels: NativeLayerOps,
                  scratch: DecodeScratch, int8_inputs: bool = False) -> GgufLinear:
        """One matrix in place of ``linear``, whose bias it takes over (loaded already, or still on
        meta: the loader assigns it by name when it arrives)."""
        layer = cls([part], kernels, scratch, int8_inputs=int8_inputs)
        layer.bias = linear.bias
        return layer

    def stacked_with(self, others: list[GgufLinear]) -> GgufLinear:
        """One layer computing this one's outputs and then ``others``' side by side."""
        layers = [self, *others]
        biases = [layer.bias for layer in layers]
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        return GgufLinear([part for layer in layers for part in layer.parts], self.kernels, self.scratch, bias,
                          self.int8_inputs)

    def dequantized(self) -> torch.Tensor:
        """float32 ``[out, in]``: the weight the kernel multiplies by (decoded by the kernels)."""
        return torch.cat([self.kernels.gguf_rows(part.blocks, part.gguf_type, None, part.width, torch.float32)
                          for part in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).contiguous()
        out = torch.empty((flat.shape[0], self.out_features), dtype=x.dtype, device=x.device)
        if flat.shape[0] >= self.scratch.gemm_rows.get(x.dtype, flat.shape[0] + 1):
            self._decoded_gemm(flat, out)
            return out.view(*shape[:-1], self.out_features)
        start = 0
        for part in self.parts:
            bias = None if self.bias is None else self.bias[start:start + part.rows]
            if not self.kernels.gguf_linear(flat, part.blocks, part.gguf_type, bias, out[:, start:start + part.rows],
                                            self.int8_inputs):
                raise TypeError(f"the GGUF kernel does not take a {x.dtype} input on {x.device}")
            start += part.rows
        return out.view(*shape[:-1], self.out_features)

    def _decoded_gemm(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` = x times each part, decoded a slice of rows at a time and multiplied by torch's GEMM."""
        start = 0
        for part in self.parts:
            step = max(1, SCRATCH_ELEMENTS // part.width)
            for first in range(0, part.rows, step):
                rows = min(step, part.rows - first)
                weight = self.scratch.matrix(rows, part.width, x.dtype)
                self.kernels.gguf_rows(part.blocks[first:first + rows], part.gguf_type, None, part.width, x.dtype, weight)
                columns = out[:, start + first:start + first + rows]
                if columns.is_contiguous():
                    torch.mm(x, weight.t(), out=columns)
                else:
                    columns.copy_(x @ weight.t())
            start += part.rows
        if self.bias is not None:
            out += self.bias

    def extra_repr(self) -> str:
        names = {v: k for k, v in GGUF_KERNEL_TYPES.items()}
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"blocks={'+'.join(names[p.gguf_type] for p in self.parts)}"


class GgufEmbedding(nn.Module):
    """``nn.Embedding`` whose table is a ``GgufMatrix``: a looked-up row is decoded at ``dtype``."""

    def __init__(self, table: GgufMatrix, kernels: NativeLayerOps, scratch: DecodeScratch, dtype: torch.dtype,
                 int8_inputs: bool = False) -> None:
        super().__init__()
        self.table, self.kernels, self.scratch, self.dtype = table, kernels, scratch, dtype
        self.int8_inputs = int8_inputs  # as a tied head (``as_linear``)
        self.num_embeddings, self.embedding_dim = table.rows, table.width
        self.register_buffer("blocks", table.blocks, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows")
        rows = self.kernels.gguf_rows(self.table.blocks, self.table.gguf_type, ids, self.embedding_dim, self.dtype)
        if rows is None:
            raise TypeError(f"the GGUF kernel does not decode to {self.dtype}")
        return rows.view(*ids.shape, self.embedding_dim)

    def as_linear(self) -> GgufLinear:
        """The same blocks as an output head (a model whose head is tied to its embedding)."""
        return GgufLinear([self.table], self.kernels, self.scratch, int8_inputs=self.int8_inputs)


class StoredForm:
    """The weight form ``gguf`` as the loader fills a model (``worker/runner/loader.py``): a linear
    layer's or embedding's weight that the file stores in blocks the kernel runs becomes a module over
    those blocks; the formats it cannot run are counted (dequantized as usual, and said once)."""

    def __init__(self, kernels: NativeLayerOps, dtype: torch.dtype, int8_inputs: bool = False) -> None:
        self.kernels, self.dtype, self.int8_inputs = kernels, dtype, int8_inputs
        self.scratch = DecodeScratch(kernels=kernels)  # one for the model: its layers run one at a time
        self.huge_pages = huge_pages_offered()  # asked once for the model, not per matrix
        self.kept = 0
        self.dequantized: dict[str, int] = {}

    def module(self, model: nn.Module, target: str, load) -> nn.Module | None:
        """The module that runs ``target``'s blocks as stored; None where the tensor takes the usual way."""
        if not getattr(load, "quantized", False) or not target.endswith(".weight"):
            return None
        module = model.get_submodule(target.removesuffix(".weight"))
        if type(module) not in (nn.Linear, nn.Embedding):
            return None
        if not runs_as_stored(load.gguf_type, load.width):
            name = load.tensor.tensor_type.name
            self.dequantized[name] = self.dequantized.get(name, 0) + 1
            return None
        matrix = GgufMatrix(load.gguf_type, load.blocks(self.huge_pages), load.width)
        rows, width = (module.out_features, module.in_features) if type(module) is nn.Linear else \
            (module.num_embeddings, module.embedding_dim)
        if (matrix.rows, matrix.width) != (rows, width):
            raise ValueError(f"{target}: the file stores {matrix.rows} x {matrix.width}, the model expects {rows} x {width}")
        self.kept += 1
        if type(module) is nn.Embedding:
            return GgufEmbedding(matrix, self.kernels, self.scratch, self.dtype, self.int8_inputs)
        return GgufLinear.replacing(module, matrix, self.kernels, self.scratch, self.int8_inputs)
