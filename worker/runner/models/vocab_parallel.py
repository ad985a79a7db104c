"""The vocabulary-parallel embedding and LM head: each rank holds ``rows`` consecutive rows of
both (the last rank's padded), an embedding lookup is each rank's rows for the ids it holds (zeros
for the rest) summed over the ranks, and the logits are the ranks' columns side by side, the
padding cut off. Every rank gets the whole logits: the step stays the same on every rank, and only
rank 0 samples from them."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class Collectives(Protocol):
    rank: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor: ...


class VocabSlice:
    def __init__(self, group: Collectives, rows: int, vocab_size: int) -> None:
        self.group, self.rows, self.vocab_size = group, rows, vocab_size
        self.first = group.rank * rows

    def embed(self, table: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.rows)
        rows = table(local.masked_fill(outside, 0))
        return self.group.all_reduce(rows.masked_fill(outside[:, None], 0))

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(logits)[..., : self.vocab_size]
