"""StepPlan: everything the model runner needs to execute one engine step, decided by the scheduler.

The runner applies ``swap_out``, then ``swap_in``, then ``copies`` (copy-on-write), then runs one
forward over ``seqs`` and samples ``num_samples`` tokens for each seq that asks for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field



@dataclass(frozen=True)
class ScheduledSeq:
    seq_id: int
    request_id: str
    token_ids: tuple[int, ...]  # tokens whose KV this step computes
    start: int  # position of token_ids[0] in the sequence
    block_table: tuple[int, ...]
    num_samples: int  # 0: a prefill chunk that is not the last; n at a fork; else 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens of KV the sequence has once this step wrote its own."""
        return self.start + len(self.token_ids)

    def slot_mapping(self, block_size: int) -> list[int]:
        table = self.block_table
        return [table[p // block_size] * block_size + p % block_size for p in range(self.start, self.context_len)]


@dataclass(frozen=True)
class StepPlan:
    seqs: tuple[ScheduledSeq, ...]
    block_size: int
    copies: tuple[tuple[int, int], ...] = ()  # (src, dst) GPU blocks, copy-on-write
    swap_out: tuple[tuple[int, int], ...] = ()  # (gpu, cpu)
    swap_in: tuple[tuple[int, int], ...] = ()  # (cpu, gpu)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not (self.seqs or self.copies or self.swap_out or self.swap_in)

    def slot_mapping(self) -> list[int]:
        return [slot for s in self.seqs for slot in s.slot_mapping(self.block_size)]


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None  # when the request asked for logprobs


@dataclass
class StepBuilder:
    """What one ``schedule`` call has decided so far; ``build`` freezes it into a StepPlan."""

    budget: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: int = 0

    def build(self, block_size: int) -> StepPlan:
        return StepPlan(tuple(self.seqs), block_size, tuple(self.copies), tuple(self.swap_out),
                        tuple(self.swap_in), self.preempted)
