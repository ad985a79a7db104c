"""The engine's LoRA adapters: read by name (``peft_adapter.py``), their updates wrapped into the
model's linear layers (``lora_linear.py``), and on the device for the steps whose rows use them.

Every adapter read stays in host memory (float32, a few MiB at rank 16); at most ``max_loras`` are
on the device at once at the model's dtype, least recently used first out, never one the current
step needs, plus one copy of the current step's adapters stacked for the batched products (the
scheduler keeps a step to ``max_loras`` adapters; one that needs more still gets them, with a
warning). The C
decode stack (``worker/runner/cpu/native_stack.py``) adds the same updates after its matrices, so a decode step with
adapter rows stays on it.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Callable

import structlog
import torch

from pagedserve.worker.runner.lora.lora_linear import LoraLinear, LoraStep, layer_keys
from pagedserve.worker.runner.lora.peft_adapter import Cut, LoraError, PeftAdapter, read_adapter
from pagedserve.worker.runner.models.layers import MLP, Attention, CausalLM
from pagedserve.worker.runner.transfers.host_copies import device_tensor

log = structlog.get_logger("pagedserve.lora")

# (layer, PEFT target) -> (the wrapped module's key, first output row in it)
Layout = dict[tuple[int, str], tuple[str, int]]


class Adapters:
    def __init__(self, model: CausalLM, max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype,
                 kernel: Callable | None = None, cut: Cut | None = None) -> None:
        """``kernel``: the kernel ops' LoRA update (Triton on CUDA); None: the grouped batched products.
        ``cut``: a tensor-parallel rank's part of each adapter matrix (``Shard.lora_piece``)."""
        self.cut = cut
        self.model, self.max_loras, self.max_rank, self.device, self.dtype = model, max_loras, max_rank, device, dtype
        self.step = LoraStep(kernel=kernel)
        self.layout, self.shapes, self.widths = wrap_layers(model, self.step)
        if model.native_stack is not None:
            model.native_stack.adapt(self.step)
        self.loaded: dict[str, PeftAdapter] = {}
        self._on_device: OrderedDict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self._stacked: tuple[tuple[str, ...], dict] | None = None  # the last step's adapters and their stacked matrices
        self.on_forget: list[Callable[[str], None]] = []  # told of an adapter unloaded or read again (the graphs' stack)

    def load(self, name: str, path: str | Path) -> PeftAdapter:
        """Read and check the adapter at ``path`` under ``name`` (a ``LoraError`` if it cannot be
        served); loading a name again replaces it (its blocks carry the new bytes' salt)."""
        if not name or "=" in name:
            raise LoraError(f"an adapter name must be non-empty and hold no '=', got {name!r}")
        adapter = read_adapter(name, path, self.max_rank, self.shapes, self.cut)
        self.loaded[name] = adapter
        self._forget(name)
        log.info("lora adapter loaded", name=name, path=str(adapter.path), rank=adapter.rank, modules=len(adapter.weights))
        return adapter

    def unload(self, name: str) -> None:
        if self.loaded.pop(name, None) is None:
            raise LoraError(f"no adapter named {name!r} is loaded")
        self._forget(name)

    def _forget(self, name: str) -> None:
        self._on_device.pop(name, None)
        if self._stacked is not None and name in self._stacked[0]:
            self._stacked = None
        for listener in self.on_forget:
            listener(name)

    def salt(self, name: str) -> str:
        adapter = self.loaded.get(name)
        if adapter is None:
            raise LoraError(f"no adapter named {name!r} is loaded (loaded: {', '.join(sorted(self.loaded)) or 'none'})")
        return adapter.key

    def prepare(self, items) -> None:
        """Rows of ``items`` (in batch order, each ``num_tokens`` tokens) grouped by adapter for the
        next forward (``LoraStep``)."""
        rows: dict[str, list[int]] = {}
        at = 0
        for item in items:
            if item.adapter is not None:
                rows.setdefault(item.adapter, []).extend(range(at, at + item.num_tokens))
            at += item.num_tokens
        if not rows:
            self.clear()
            return
        names = tuple(sorted(rows))
        step = self.step
        step.adapters = len(names)
        if step.kernel is not None:  # each token's place in the stack: one kernel call per layer
            slots = [-1] * at
            for n, name in enumerate(names):
                for i in rows[name]:
                    slots[i] = n
            step.slots = device_tensor(slots, torch.int32, self.device)
        else:  # one block of rows per adapter, padded to the longest: two batched products per layer
            width = max(len(r) for r in rows.values())
            gather = [i for name in names for i in rows[name] + rows[name][:1] * (width - len(rows[name]))]
            valid = [n * width + j for n, name in enumerate(names) for j in range(len(rows[name]))]
            as_index = lambda values: device_tensor(values, torch.int64, self.device)  # noqa: E731
            step.gather, step.rows, step.width = as_index(gather), as_index([i for n in names for i in rows[n]]), width
            step.valid = None if len(valid) == len(gather) else as_index(valid)
        step.weights = self._weights(names)

    def clear(self) -> None:
        self.step.gather = self.step.valid = self.step.rows = self.step.slots = None
        self.step.weights = {}

    def _weights(self, names: tuple[str, ...]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The adapters' matrices stacked per layer key (kept while the same adapters share the steps)."""
        if self._stacked is not None and self._stacked[0] == names:
            return self._stacked[1]
        needed = set(names)
        each = [self._matrices(name, needed) for name in names]
        stacked = {key: _stacked_pairs([m.get(key) for m in each], self.widths[key]) for key in self.widths
                   if any(key in m for m in each)}
        self._stacked = (names, stacked)
        return stacked

    def _matrices(self, name: str, needed: set[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The adapter's A and B per wrapped module, on the device (made once, kept while recent)."""
        matrices = self._on_device.get(name)
        made = matrices is None
        if made:
            matrices = self._on_device[name] = stacked(self.loaded[name], self.layout, self.widths, self.device, self.dtype)
        self._on_device.move_to_end(name)
        spare = [n for n in self._on_device if n not in needed]  # least recent first
        while len(self._on_device) > self.max_loras and spare:  # also what a step past the limit left
            self._on_device.pop(spare.pop(0))
        if made and len(self._on_device) > self.max_loras:
            log.warning("more adapters in one step than --max-loras", step_adapters=len(needed), max_loras=self.max_loras)
        return matrices


def wrap_layers(model: CausalLM, step: LoraStep) -> tuple[Layout, dict[tuple[int, str], tuple[int, int]], dict[str, int]]:
    """Wrap every attention and dense feed-forward projection in a ``LoraLinear`` sharing ``step``:
    where each PEFT target lands, each target's (in, out), and each wrapped module's output width."""
    layout: Layout = {}
    shapes: dict[tuple[int, str], tuple[int, int]] = {}
    widths: dict[str, int] = {}
    hidden = model.config.hidden_size

    def wrap(i: int, owner, attr: str, key: str, parts: list[tuple[str, int, int]]) -> None:
        setattr(owner, attr, LoraLinear(getattr(owner, attr), key, step))
        widths[key] = sum(out for _, _, out in parts)
        at = 0
        for target, width, out in parts:
            layout[(i, target)], shapes[(i, target)] = (key, at), (width, out)
            at += out

    def wrap_fusable(i: int, owner, fused_attr: str, key: str, parts: list[tuple[str, int, int]]) -> None:
        """One wrapper around the fused matrix, or one per part where the block is not fused."""
        if owner.fused:
            wrap(i, owner, fused_attr, key, parts)
        else:
            for part in parts:
                wrap(i, owner, part[0], f"{i}.{part[0]}", [part])

    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        qkv_key, o_key, gate_up_key, down_key = layer_keys(i)
        if isinstance(attn, Attention):
            nq, nk, _ = attn.qkv_sizes
            wrap_fusable(i, attn, "qkv_proj", qkv_key, [("q_proj", hidden, nq), ("k_proj", hidden, nk), ("v_proj", hidden, nk)])
            wrap(i, attn, "o_proj", o_key, [("o_proj", nq, hidden)])
        mlp = layer.mlp
        if isinstance(mlp, MLP):  # a mixture of experts is not adapted (an adapter naming it is refused)
            size = mlp.intermediate_size
            wrap_fusable(i, mlp, "gate_up_proj", gate_up_key, [("gate_proj", hidden, size), ("up_proj", hidden, size)])
            wrap(i, mlp, "down_proj", down_key, [("down_proj", size, hidden)])
    return layout, shapes, widths


def stacked(adapter: PeftAdapter, layout: Layout, widths: dict[str, int], device: torch.device,
            dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per wrapped module: A of its parts stacked ``[sum r, in]`` and B block-diagonal ``[out, sum r]``."""
    parts: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, target), (a, b) in adapter.weights.items():
        key, at = layout[(layer, target)]
        parts.setdefault(key, []).append((at, a, b))
    out = {}
    for key, pieces in parts.items():
        a = torch.cat([p[1] for p in pieces])
        b = a.new_zeros((widths[key], a.shape[0]))  # float32 on the host, as the adapter's matrices
        r = 0
        for at, pa, pb in pieces:
            b[at : at + pb.shape[0], r : r + pa.shape[0]] = pb
            r += pa.shape[0]
        out[key] = (a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
    return out


def _stacked_pairs(pairs: list, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per adapter (None: it does not adapt this layer) A ``[r, in]`` and B ``[out, r]`` -> A
    ``[adapters, rank, in]`` and B ``[adapters, out, rank]``, ranks padded with zeros to the largest."""
    known = [p for p in pairs if p is not None]
    rank, inputs = max(a.shape[0] for a, _ in known), known[0][0].shape[1]
    a_all = known[0][0].new_zeros((len(pairs), rank, inputs))
    b_all = known[0][1].new_zeros((len(pairs), width, rank))
    for n, pair in enumerate(pairs):
        if pair is not None:
            a, b = pair
            a_all[n, : a.shape[0]] = a
            b_all[n, :, : a.shape[0]] = b
    return a_all, b_all
