"""The LoRA adapters' matrices where a CUDA graph can read them (``worker/runner/device/cuda_graphs.py``).

A graph replays the kernels it captured on the same buffers, so the adapters of a decode step cannot
come as freshly stacked tensors (``Adapters.prepare``): here every wrapped layer has one A
``[max_loras, rank, in]`` and one B ``[max_loras, out, rank]`` on the device for the engine's life,
``rank`` room for each of the layer's parts at ``max_lora_rank`` (zeros where an adapter has no update:
exact). An adapter takes a place when a step first needs it and keeps it while it stays (least
recently used out, never one the step needs); each graph's tokens name their adapter's place in a
slots buffer of their own (-1: the base model's). Only for the kernel ops' per-token update
(``LoraStep.kernel``), which reads a token's place from the slots.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager

import torch

from pagedserve.worker.runner.lora.adapters import Adapters, stacked


class GraphStack:
    def __init__(self, adapters: Adapters) -> None:
        if adapters.step.kernel is None:
            raise ValueError("adapters in a CUDA graph need the kernel ops' LoRA update (Triton)")
        self.adapters = adapters
        places, made = adapters.max_loras, dict(dtype=adapters.dtype, device=adapters.device)
        self.weights = {key: (torch.zeros((places, rank, inputs), **made), torch.zeros((places, outputs, rank), **made))
                        for key, (rank, inputs, outputs) in _sizes(adapters).items()}
        self._placed: OrderedDict[str, int] = OrderedDict()  # adapter -> its place, least recently used first
        adapters.on_forget.append(self.forget)

    def fits(self, names: set[str]) -> bool:
        """Whether one step's adapters fit the places at once."""
        return len(names) <= self.adapters.max_loras

    def load(self, items, slots: torch.Tensor, width: int = 1) -> None:
        """Each token of ``items`` (rows of ``width`` token places, in batch order) its adapter's place
        in ``slots``, the rest of the buffer -1; adapters the stack lacks copied in first (from the
        host, without a sync)."""
        places = self._place({item.adapter for item in items if item.adapter is not None})
        values = [places[item.adapter] if item.adapter is not None else -1 for item in items for _ in range(width)]
        values += [-1] * (slots.shape[0] - len(values))
        slots.copy_(torch.tensor(values, dtype=slots.dtype, device="cpu"), non_blocking=True)

    @contextmanager
    def bound(self, slots: torch.Tensor):
        """The adapters' step reading this stack and ``slots`` while a graph's forward runs (captured,
        or run as it would be on the CPU); cleared after."""
        step = self.adapters.step
        step.weights, step.slots, step.adapters = self.weights, slots, self.adapters.max_loras
        try:
            yield
        finally:
            self.adapters.clear()

    def _place(self, names: set[str]) -> dict[str, int]:
        if not self.fits(names):
            raise ValueError(f"{len(names)} adapters in one graph step; places for {self.adapters.max_loras}")
        for name in sorted(names - set(self._placed)):
            free = set(range(self.adapters.max_loras)) - set(self._placed.values())
            if not free:
                gone = next(n for n in self._placed if n not in names)
                free = {self._placed.pop(gone)}
            self._placed[name] = place = min(free)
            self._write(name, place)
        for name in sorted(names):
            self._placed.move_to_end(name)
        return dict(self._placed)

    def _write(self, name: str, place: int) -> None:
        a = self.adapters
        matrices = stacked(a.loaded[name], a.layout, a.widths, a.device, a.dtype)
        for key, (a_all, b_all) in self.weights.items():
            a_all[place].zero_()
            b_all[place].zero_()
            pair = matrices.get(key)
            if pair is not None:
                rank = pair[0].shape[0]
                a_all[place, :rank].copy_(pair[0])
                b_all[place, :, :rank].copy_(pair[1])

    def forget(self, name: str) -> None:
        """An adapter unloaded or read again: its place is free (its next use copies it anew)."""
        self._placed.pop(name, None)


def _sizes(adapters: Adapters) -> dict[str, tuple[int, int, int]]:
    """Each wrapped layer's (rank room, inputs, outputs): ``max_lora_rank`` for each of its parts."""
    inputs: dict[str, int] = {}
    parts: dict[str, int] = {}
    for (layer, target), (key, _) in adapters.layout.items():
        inputs[key] = adapters.shapes[(layer, target)][0]
        parts[key] = parts.get(key, 0) + 1
    return {key: (parts[key] * adapters.max_rank, inputs[key], width) for key, width in adapters.widths.items()}


def stack_bytes(adapters: Adapters) -> int:
    """Device bytes a ``GraphStack`` of ``adapters`` holds (left free beside the KV pool)."""
    element = torch.empty((), dtype=adapters.dtype, device="meta").element_size()
    return sum(adapters.max_loras * rank * (inputs + outputs) * element for rank, inputs, outputs in _sizes(adapters).values())
