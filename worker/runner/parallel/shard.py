"""Which part of the model one rank holds, and how each checkpoint tensor is cut for it.

Column-parallel: q/k/v (by heads) and gate/up (by intermediate rows), experts' gate/up included;
row-parallel: o_proj and down_proj (by the matching input columns; a bias stays on rank 0 only, the
sum across ranks adds it once). The embedding and the LM head are cut by vocabulary rows (the last
rank's slice padded). KV heads are split like q heads; with fewer KV heads than ranks each is
replicated on the ranks whose q heads read it. Norms, routers and rotary tables are whole on every
rank. Experts are cut inside (each rank holds every expert's slice of the intermediate width), so
routing and load are the same on every rank and the MoE block needs one sum, as a dense MLP does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from typing import Callable

import torch

Load = Callable[[], torch.Tensor]  # reads a checkpoint tensor whole (and, where it has ``narrow``, a part of it)

COLUMN_HEADS = ("q_proj",)
COLUMN_KV = ("k_proj", "v_proj")
COLUMN_INTERMEDIATE = ("gate_proj", "up_proj")
ROW_HEADS = ("o_proj",)
ROW_INTERMEDIATE = ("down_proj",)
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


class ShardError(ValueError):
    """The model cannot be split over this many ranks."""


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int

    def check(self, config) -> None:
        """A ``ShardError`` naming what does not divide by the rank count (or what cannot be cut)."""
        heads, kv_heads = _heads(config)
        problems = []
        if heads % self.size:
            problems.append(f"{heads} attention heads")
        if kv_heads % self.size and self.size % kv_heads:
            problems.append(f"{kv_heads} KV heads (neither a multiple of the ranks nor dividing them)")
        for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
            width = getattr(config, name, None)
            if width and width % self.size:
                problems.append(f"{name} {width}")
        if getattr(config, "model_type", "") == "olmoe":
            problems.append("OLMoE's q/k norm over the whole projection (it would need a sum across ranks)")
        if problems:
            raise ShardError(f"{config.model_type} cannot be split over {self.size} ranks (tensor parallel): "
                             + "; ".join(problems) + " do not divide")

    def rank_config(self, config):
        """A copy of ``config`` sized for this rank's slice: its heads, intermediate widths and
        vocabulary rows (the model classes build from it unchanged)."""
        heads, kv_heads = _heads(config)
        out = copy.copy(config)
        out.head_dim = _head_dim(config)
        out.num_attention_heads = heads // self.size
        out.num_key_value_heads = max(1, kv_heads // self.size)
        for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
            if getattr(config, name, None):
                setattr(out, name, getattr(config, name) // self.size)
        out.vocab_size = self.vocab_rows(config.vocab_size)
        return out

    def vocab_rows(self, vocab_size: int) -> int:
        """Rows of the embedding and head on each rank (the last one's padded)."""
        return -(-vocab_size // self.size)

    def piece(self, name: str, load: Load, config) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name`` (under the model's parameter name), read
        with ``load`` (only that part, where ``load`` can ``narrow``: a safetensors file)."""
        heads, kv_heads = _heads(config)
        head_dim = _head_dim(config)
        module, kind = _module_and_kind(name)
        if name in VOCAB:
            rows = self.vocab_rows(config.vocab_size)
            lo = min(self.rank * rows, config.vocab_size)  # a rank wholly past a small vocabulary holds padding alone
            part = _narrow(load, 0, lo, max(0, min(rows, config.vocab_size - lo)))
            if len(part) < rows:
                part = torch.cat([part, part.new_zeros((rows - len(part), *part.shape[1:]))])
            return part
        if module in COLUMN_HEADS:
            return _cut(load, 0, self._even(heads), head_dim)
        if module in COLUMN_KV:
            return _cut(load, 0, self._kv_range(kv_heads), head_dim)
        if module in ROW_HEADS:
            return _rank_zero_bias(load(), self.rank) if kind == "bias" else _cut(load, 1, self._even(heads), head_dim)
        if module in COLUMN_INTERMEDIATE:
            return _cut(load, 0, self._even(config_width(config, name)), 1)
        if module in ROW_INTERMEDIATE:
            return _rank_zero_bias(load(), self.rank) if kind == "bias" else _cut(load, 1, self._even(config_width(config, name)), 1)
        return load()

    def lora_piece(self, layer: int, target: str, a: torch.Tensor, b: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a LoRA adapter's ``A`` ``[r, in]`` and ``B`` ``[out, r]`` for ``target``
        of ``layer``: a column-parallel layer's B cut by rows as its weight is, a row-parallel one's A
        by columns (its update then joins the layer's partial sum); the other matrix whole."""
        name = f"model.layers.{layer}.{target}.weight"  # ``piece`` reads a name's last two parts
        if target in ROW_HEADS + ROW_INTERMEDIATE:
            return self.piece(name, lambda: a, config), b
        return a, self.piece(name, lambda: b, config)

    def expert_piece(self, part: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of one expert's ``gate``, ``up`` (rows) or ``down`` (columns) matrix."""
        dim = 1 if part == "down" else 0
        return tensor.narrow(dim, *_span(self._even(tensor.shape[dim]), 1)).contiguous()

    def _kv_range(self, kv_heads: int) -> tuple[int, int]:
        if kv_heads >= self.size:
            return self._even(kv_heads)
        head = self.rank // (self.size // kv_heads)  # replicated: the KV head this rank's q heads read
        return head, head + 1

    def _even(self, count: int) -> tuple[int, int]:
        each = count // self.size
        return self.rank * each, (self.rank + 1) * each


def _heads(config) -> tuple[int, int]:
    heads = config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _module_and_kind(name: str) -> tuple[str, str]:
    parts = name.split(".")
    return (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)


def _span(span: tuple[int, int], unit: int) -> tuple[int, int]:
    """(start, length) in rows of ``span`` counted in units of ``unit`` rows (a head's)."""
    lo, hi = span
    return lo * unit, (hi - lo) * unit


def _cut(load: Load, dim: int, span: tuple[int, int], unit: int) -> torch.Tensor:
    return _narrow(load, dim, *_span(span, unit))


def _narrow(load: Load, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows ``start:start + length`` of the tensor along ``dim``: read alone where ``load`` can (a
    safetensors slice), else cut from the whole (a GGUF tensor is dequantized whole)."""
    narrow = getattr(load, "narrow", None)
    if narrow is not None:
        return narrow(dim, start, length)
    return load().narrow(dim, start, length).contiguous()


def config_width(config, name: str) -> int:
    """The full intermediate width of the dense MLP ``name`` belongs to (a Qwen2-MoE shared expert's
    own, or the model's)."""
    if ".shared_expert." in name:
        return config.shared_expert_intermediate_size
    return config.intermediate_size


def _rank_zero_bias(bias: torch.Tensor, rank: int) -> torch.Tensor:
    return bias if rank == 0 else torch.zeros_like(bias)
