"""Where a model's weights come from on disk: every tensor of its safetensors shards, or of its one
GGUF file, by checkpoint name, each read only when asked (the loader streams them layer by layer,
``worker/runner/loader.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from pagedserve.worker.source.gguf_file import open_gguf
from pagedserve.worker.source.gguf_weights import gguf_tensors


def checkpoint_tensors(path: Path) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """``(checkpoint name, load)`` for every tensor of the model at ``path``: its safetensors
    shards, else its one GGUF file (dequantized, under the checkpoint's names)."""
    files = sorted(path.glob("*.safetensors"))
    if files:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, _SafetensorsTensor(f, name)
        return
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) != 1:
        raise FileNotFoundError(f"no *.safetensors weights (nor one *.gguf file) in {path}")
    yield from gguf_tensors(open_gguf(ggufs[0]))


class _SafetensorsTensor:
    """Reads one tensor of an open safetensors file: whole when called, or only a range of rows
    along one dimension (``narrow``: a tensor-parallel rank's slice)."""

    def __init__(self, file, name: str) -> None:
        self.file, self.name = file, name

    def __call__(self) -> torch.Tensor:
        return self.file.get_tensor(self.name)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.file.get_slice(self.name)[(slice(None),) * dim + (slice(start, start + length),)]
