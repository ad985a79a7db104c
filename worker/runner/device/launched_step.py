"""A step the runner has queued on the device (``ModelRunner.launch``): what is known at once (draft
checks, beam steps, prompt logprobs, embeddings: rows that read their logits on the host) and the
sampled tokens still on their way to the host (``DrawnTokens``).

``result()`` waits for those tokens alone. ``placeholders(items)`` tells the next step where its
rows' placeholder tokens (``worker/core/scheduling/run_ahead.py``) come from: this step's tokens,
still on the device; ``history_tails(items, vocab)`` gives its penalties the same tokens, for the
histories that end in a placeholder.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from pagedserve.worker.core.scheduling.plan import ScheduledSeq, StepResult
from pagedserve.worker.core.scheduling.run_ahead import PLACEHOLDER
from pagedserve.worker.runner.sampling.drawn_tokens import DrawnTokens
from pagedserve.worker.runner.transfers.host_copies import device_tensor


@dataclass(frozen=True)
class Placeholders:
    """Where a step's placeholder tokens are among its token places, and their values (a previous
    step's tokens, on the device)."""

    offsets: list[int]  # each placeholder's index among the step's tokens, rows in batch order
    values: torch.Tensor  # int64 [len(offsets)]

    def fill(self, ids: torch.Tensor, places: list[int]) -> None:
        """Write the values into ``ids``, token ``k`` of the step being at ``places[k]`` there."""
        where = device_tensor([places[k] for k in self.offsets], torch.int64, ids.device)
        ids.index_copy_(0, where, self.values)


@dataclass
class StepTimer:
    """A launch's time: the host's wall clock, and on CUDA events around the device's work."""

    device: torch.device
    started: float = 0.0
    host_seconds: float = 0.0
    events: tuple = ()

    def __post_init__(self) -> None:
        self.started = time.perf_counter()
        if self.device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()

    def stop(self) -> None:
        self.host_seconds = time.perf_counter() - self.started
        if self.events:
            self.events[1].record()

    def seconds(self) -> float:
        """The device's time for the step once it is done (the host's launch time on the CPU)."""
        if self.events:
            self.events[1].synchronize()
            return self.events[0].elapsed_time(self.events[1]) / 1e3
        return self.host_seconds


@dataclass
class LaunchedStep:
    known: StepResult  # what the host has already: draft checks, beams, prompt logprobs, embeddings
    sampled: tuple[ScheduledSeq, ...] = ()  # the rows ``drawn`` holds, in its order
    drawn: DrawnTokens | None = None
    timer: StepTimer | None = None

    def result(self) -> StepResult:
        """The step's whole result (waits for its sampled tokens to reach the host)."""
        if self.drawn is None:
            return self.known
        samples = {item.seq_id: tuple(tokens) for item, tokens in zip(self.sampled, self.drawn.read())}
        return replace(self.known, samples={**self.known.samples, **samples})

    def history_tails(self, items: list[ScheduledSeq], vocab: int) -> torch.Tensor | None:
        """For rows whose token history (penalties) ends in a placeholder, this step's token for it,
        on the device (``vocab`` for the others); None when no row's does."""
        first = self.first_rows
        tails = [first.get(item.seq_id, -1) if item.output_ids[-1:] == (PLACEHOLDER,) else -1 for item in items]
        if all(t < 0 for t in tails):
            return None
        picks = device_tensor([max(t, 0) for t in tails], torch.int64, self.drawn.tokens.device)
        held = device_tensor([t >= 0 for t in tails], torch.bool, self.drawn.tokens.device)
        return torch.where(held, self.drawn.tokens.index_select(0, picks), vocab)

    @cached_property
    def first_rows(self) -> dict[int, int]:
        """Each sampled sequence's first token among ``drawn``'s (asked by the next step twice: its
        placeholders and its penalties' history)."""
        first, at = {}, 0
        for item in self.sampled:
            first[item.seq_id] = at
            at += item.num_samples
        return first

    def placeholders(self, items: list[ScheduledSeq]) -> Placeholders | None:
        """The placeholder tokens of ``items`` (the next step's rows, in batch order), filled from this
        step's tokens; None when they have none. A ValueError for one this step did not sample."""
        first = self.first_rows
        offsets, picks, at = [], [], 0
        for item in items:  # a placeholder ends its sequence: a row starts at it
            if item.token_ids[0] == PLACEHOLDER:
                if item.seq_id not in first:
                    raise ValueError(f"seq {item.seq_id}: a placeholder token the previous step did not sample")
                offsets.append(at)
                picks.append(first[item.seq_id])
            at += item.num_tokens
        if not offsets:
            return None
        return Placeholders(offsets, self.drawn.tokens.index_select(0, device_tensor(picks, torch.int64, self.drawn.tokens.device)))
