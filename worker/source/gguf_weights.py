"""The tensors of a GGUF file under their Hugging Face checkpoint names, dequantized, so the
loader fills a model from a GGUF exactly as from safetensors (``worker/runner/loader.py``).

GGUF's tensor names are llama.cpp's (``blk.3.attn_q.weight``); each maps onto the name a
transformers checkpoint of the family uses, and the family's own ``rename`` takes it from there.
What llama.cpp's converter changed is undone here, as transformers' GGUF reader undoes it:
- ``llama`` files (Llama, Mistral, Mixtral) hold q/k rows permuted for llama.cpp's interleaved
  rope; they are permuted back to the half-split order;
- Gemma files store every norm weight plus one; one is taken off;
- experts are stacked in one 3-D tensor per layer; they are split into per-expert checkpoint names.
"""

from __future__ import annotations

import mmap
import re
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from pagedserve.kernels.host_memory import huge_page_empty, huge_pages_offered
from pagedserve.worker.source.gguf_file import PLAIN_FORMATS, GGUFError, GGUFFile

GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER = {  # blk.{i}.<gguf> -> model.layers.{i}.<checkpoint>
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
LAYER_BY_FAMILY = {  # where a family's checkpoint names differ from the common ones
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # Phi-3's gate and up in one tensor, as its checkpoints have them
    "mixtral": {"ffn_gate_inp": "block_sparse_moe.gate"},
}
LAYER_BY_FAMILY["gemma3_text"] = LAYER_BY_FAMILY["gemma2"]
EXPERTS = {  # blk.{i}.ffn_<part>_exps [E, out, in] -> one checkpoint tensor per expert
    "mixtral": ("block_sparse_moe.experts.{e}.", {"gate": "w1", "up": "w3", "down": "w2"}),
    "qwen_moe": ("mlp.experts.{e}.", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
}
_NAME = re.compile(r"blk\.(\d+)\.(\w+?)\.(weight|bias)")
_EXPERTS = re.compile(r"ffn_(gate|up|down)_exps")

Load = Callable[[], torch.Tensor]
CHUNK_ELEMENTS = 1 << 21  # raw values dequantized at a time


def gguf_tensors(gguf: GGUFFile) -> Iterator[tuple[str, Load]]:
    """``(checkpoint name, load)`` for every tensor of the file that has a checkpoint name; ``load``
    dequantizes it (float32) when called (and gives its blocks as stored: ``GgufTensor``). Tensors
    without one (llama.cpp-only extras) are skipped."""
    layer = {**LAYER, **LAYER_BY_FAMILY.get(gguf.family, {})}
    experts = EXPERTS["mixtral" if gguf.family == "mixtral" else "qwen_moe"]
    heads = gguf.value("{arch}.attention.head_count")
    kv_heads = gguf.value("{arch}.attention.head_count_kv", heads)
    tensors = [(tensor, _fix(gguf, tensor.name, heads, kv_heads)) for tensor in gguf.tensors]
    path = gguf.path
    for tensor, fix in tensors:
        found = _NAME.fullmatch(tensor.name)
        if found is None:
            base, _, suffix = tensor.name.rpartition(".")
            if base in GLOBAL:
                yield f"{GLOBAL[base]}.{suffix}", GgufTensor(path, tensor, fix)
            continue
        block, part, suffix = found.groups()
        expert_part = _EXPERTS.fullmatch(part)
        if expert_part:
            template, parts = experts
            stacked = GgufTensor(path, tensor, fix)
            yield from _per_expert(f"model.layers.{block}.{template}{parts[expert_part[1]]}.{suffix}", stacked,
                                   int(tensor.shape[-1]))
        elif part in layer:
            yield f"model.layers.{block}.{layer[part]}.{suffix}", GgufTensor(path, tensor, fix)


def _fix(gguf: GGUFFile, name: str, heads: int, kv_heads: int) -> Callable[[np.ndarray], np.ndarray]:
    """What undoes llama.cpp's conversion of this tensor."""
    if gguf.architecture == "llama" and (".attn_q." in name or ".attn_k." in name):
        return lambda w: unpermute_rope(w, heads if ".attn_q." in name else kv_heads)
    if gguf.family in ("gemma2", "gemma3_text") and name.endswith("norm.weight"):
        return lambda w: w - 1
    if name.endswith("ffn_gate_inp_shexp.weight"):  # stored as [H]; checkpoints hold [1, H]
        return lambda w: w.reshape(1, -1)
    return lambda w: w


def unpermute_rope(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's rotary halves (row pairs); put them back."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


class GgufTensor:
    """One tensor of the file: called, its values dequantized (float32) from the file's bytes (not
    through the reader's memory map, whose pages would stay resident, counted in the worker's RSS,
    until the whole file had been read), a few rows at a time (the ``gguf`` dequantizers hold several
    float32 copies of what they are given: for a vocabulary-sized table, hundreds of MiB at once);
    ``blocks()``: a quantized matrix's bytes as stored, a row of blocks per output (the weight form
    that runs them, ``worker/runner/cpu/gguf_linear.py``)."""

    def __init__(self, path: Path, tensor, fix: Callable[[np.ndarray], np.ndarray]) -> None:
        self.path, self.tensor, self.fix = path, tensor, fix
        self.gguf_type = int(tensor.tensor_type)
        self.bytes_per_row = tensor.raw_dtype == np.uint8 and len(tensor.raw_shape) >= 2  # dequantized a few rows at a time
        # a matrix in a quantized block format (what the stored form may keep)
        self.quantized = self.bytes_per_row and len(tensor.raw_shape) == 2 and tensor.tensor_type.name not in PLAIN_FORMATS
        self.width = int(tensor.shape[0])  # GGUF lists dimensions innermost first

    def _raw(self) -> np.ndarray:
        return self._read_into(np.empty(self.tensor.raw_shape, dtype=self.tensor.raw_dtype))

    def _mapped(self, populated: bool = False) -> np.ndarray:
        """The tensor's bytes as a mapping of the file (the page cache's pages, no copy): read-only, or
        ``populated``: private (written to, a page would be copied; the file never is) with every page
        mapped at once (``MAP_POPULATE``: 1.1 GB of 4-bit blocks in a second where reading them into
        fresh memory took 2.9 s)."""
        tensor = self.tensor
        start = tensor.data_offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        size = tensor.data_offset - start + tensor.n_bytes
        with open(self.path, "rb") as f:
            if populated:
                pages = mmap.mmap(f.fileno(), size, offset=start, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0),
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
            else:
                pages = mmap.mmap(f.fileno(), size, offset=start, access=mmap.ACCESS_READ)
        count = int(np.prod(tensor.raw_shape, dtype=np.int64))
        return np.frombuffer(pages, dtype=tensor.raw_dtype, count=count, offset=tensor.data_offset - start).reshape(tensor.raw_shape)

    def blocks(self, huge_pages: bool | None = None) -> torch.Tensor:
        """uint8 ``[rows, row bytes]``: the file's blocks as it lays them out (rows the converter permuted
        put back). Where Linux offers huge pages (``huge_pages``: None asks it), read once from the file
        into memory on them (``paged_kernels/host_memory.py``): the kernels stream them ~25% faster from
        there than from the file's mapped page-cache pages. Read, not copied from a mapping of the file,
        whose page faults cost more than the copy: the 1.5B's 1.1 GB in 2.0 s instead of 2.5 s in the worker
        (2-core EPYC; most of the 2.0 is Linux finding fresh 2 MiB pages). Elsewhere a copy gains nothing:
        the file's pages stay mapped."""
        if not (huge_pages_offered() if huge_pages is None else huge_pages):
            fixed = self.fix(self._mapped(populated=True))
        else:
            fixed = self.fix(self._read_into(huge_page_empty(tuple(self.tensor.raw_shape), torch.uint8).numpy()))
        return torch.from_numpy(fixed if fixed.flags.c_contiguous and fixed.flags.writeable else np.ascontiguousarray(fixed))

    def _read_into(self, out: np.ndarray) -> np.ndarray:
        """``out`` (the tensor's raw shape and dtype, contiguous) filled with its bytes from the file."""
        view, done = memoryview(out).cast("B"), 0
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.tensor.data_offset)
            while done < len(view):
                count = f.readinto(view[done:])
                if not count:
                    raise GGUFError(f"{self.path} is a truncated GGUF file: it ends inside tensor {self.tensor.name}")
                done += count
        return out

    def __call__(self) -> torch.Tensor:
        from gguf import dequantize
        from gguf.quants import quant_shape_from_byte_shape

        raw = self._raw()
        if not self.bytes_per_row:  # vectors and plain floats: converted as they are
            data = dequantize(raw, self.tensor.tensor_type)
        else:  # quantized blocks, a byte row per row
            data = np.empty(quant_shape_from_byte_shape(raw.shape, self.tensor.tensor_type), dtype=np.float32)
            step = max(1, CHUNK_ELEMENTS // raw[0].size)
            for start in range(0, raw.shape[0], step):
                data[start:start + step] = dequantize(raw[start:start + step], self.tensor.tensor_type)
        return torch.from_numpy(np.require(self.fix(data), np.float32, ["C", "W"]))


def _per_expert(template: str, stacked: Load, count: int) -> Iterator[tuple[str, Load]]:
    """Split a stacked ``[E, out, in]`` tensor: dequantized once, on the first expert's load."""
    cache: list[torch.Tensor] = []

    def expert(e: int) -> Load:
        def load() -> torch.Tensor:
            if not cache:
                cache.append(stacked())
            return cache[0][e]

        return load

    for e in range(count):
        yield template.format(e=e), expert(e)
