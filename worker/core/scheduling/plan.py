"""StepPlan and StepResult: what one engine step does, decided by the scheduler, and what the
model runner hands back.

The runner applies ``swap_out``, then ``swap_in``, then ``copies`` (copy-on-write), then runs one
forward over ``seqs`` and samples ``num_samples`` tokens for each seq that asks for them. Each
``ScheduledSeq`` carries its request's sampling parameters (and, when penalties need it, the token
history), so the runner samples without asking the scheduler anything; beam-search rows carry
their request's live beams, and the runner returns the search's next step for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.core.kv_cache.tiers import NO_TIER_MOVES, TierMoves


@dataclass(frozen=True)
class ScheduledSeq:
    seq_id: int
    request_id: str
    token_ids: tuple[int, ...]  # tokens whose KV this step computes
    start: int  # position of token_ids[0] in the sequence
    block_table: tuple[int, ...]  # the table's entries from table_from on (the runner keeps the ones before)
    num_samples: int  # 0: a prefill chunk that is not the last; n at a fork; else 1
    params: SamplingParams = SamplingParams()
    seq_index: int = 0  # which of the request's outputs (the first of a fork's rows)
    num_output: int = 0  # tokens this sequence has generated so far
    prompt_ids: tuple[int, ...] = ()  # token history, only when penalties need it
    output_ids: tuple[int, ...] = ()
    beam_group: tuple[int, ...] = ()  # beam search: the request's live beams (seq ids), in order
    grammar: object = None  # the sequence's GrammarState when its output is constrained (sampling rows only)
    seq_len: int = 0  # the sequence's length now, computed or not (rope that changes with length reads it)
    prompt_targets: tuple[int, ...] = ()  # prompt_logprobs: the prompt token after each of the first positions
    num_draft: int = 0  # speculative decoding: the last num_draft of token_ids are drafts the runner checks
    draft_grammars: tuple = ()  # with a grammar: its state before each draft and after the last
    draft_context: tuple[int, ...] | None = None  # a draft model proposes (the drafts here are 0 until then): the tokens before start it has no KV for
    pool_from: int | None = None  # an embedding (params.pooling): positions before this are pooled already
    adapter: str | None = None  # the LoRA adapter its request runs under (worker/runner/lora/); None: the base model
    lane_tables: tuple[tuple[int, ...], ...] = ()  # the tables of the lanes after the first (kv_layout.py), as block_table
    table_from: int = 0  # the first table entry this row carries, in every lane; 0: the whole tables

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens of KV the sequence has once this step wrote its own."""
        return self.start + len(self.token_ids)

    def table(self, lane: int) -> tuple[int, ...]:
        """The entries this row carries of ``lane``'s block table (0: ``block_table``)."""
        return self.block_table if lane == 0 else self.lane_tables[lane - 1]

    def check_kept(self, num_kept: int) -> None:
        """A ValueError unless a keeper holding ``num_kept`` entries of the table can take this row:
        one that goes on past them means a step's changes were lost (its attention would read other
        blocks)."""
        if num_kept < self.table_from:
            raise ValueError(f"seq {self.seq_id}: its row goes on from table entry {self.table_from}, but only "
                             f"{num_kept} are kept: a step's table changes were lost")

    def kept_table(self, kept: Sequence[int], lane: int = 0) -> list[int]:
        """``lane``'s whole table, from ``kept`` (the table as this sequence's previous row left it)
        and this row's entries."""
        self.check_kept(len(kept))
        return [*kept[: self.table_from], *self.table(lane)]

    def slot_mapping(self, block_size: int, table: Sequence[int]) -> list[int]:
        """The slot of each position this row computes, in ``table`` (a whole one)."""
        return [table[p // block_size] * block_size + p % block_size for p in range(self.start, self.context_len)]


def private_tables(num_blocks: int, num_lanes: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """``(block_table, lane_tables)`` of a sequence alone in a pool (a calibration, a profile): lane
    ``k`` on blocks ``k * num_blocks ..``, so no two lanes' layers write one block."""
    tables = tuple(tuple(range(lane * num_blocks, (lane + 1) * num_blocks)) for lane in range(num_lanes))
    return tables[0], tables[1:]


@dataclass(frozen=True)
class StepPlan:
    seqs: tuple[ScheduledSeq, ...]
    block_size: int
    copies: tuple[tuple[int, int], ...] = ()  # (src, dst) GPU blocks, copy-on-write
    swap_out: tuple[tuple[int, int], ...] = ()  # (gpu, cpu)
    swap_in: tuple[tuple[int, int], ...] = ()  # (cpu, gpu)
    num_preempted: int = 0
    finished_request_ids: tuple[str, ...] = ()  # ended since the last plan: the runner drops their state
    tier: TierMoves = NO_TIER_MOVES
    dropped_seq_ids: tuple[int, ...] = ()  # beams that fell out since the last plan: the runner drops their tables

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not (self.seqs or self.copies or self.swap_out or self.swap_in or self.tier)


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None  # when the request asked for logprobs
    rank: int | None = None  # with them: the token's rank in the vocabulary by logprob (1: the most likely)


@dataclass(frozen=True)
class BeamStep:
    """One beam-search step of a request: the next beams, or the final hypotheses once done."""

    choices: tuple[tuple[int, int], ...] = ()  # (parent seq id, token), best first
    results: tuple[tuple[tuple[int, ...], float], ...] | None = None  # (tokens, score), best first


@dataclass(frozen=True)
class StepResult:
    samples: Mapping[int, tuple[SampledToken, ...]] = field(default_factory=dict)  # seq id -> num_samples tokens
    beams: Mapping[str, BeamStep] = field(default_factory=dict)  # request id -> its step, when all beams had logits
    prompt_logprobs: Mapping[int, tuple[SampledToken, ...]] = field(default_factory=dict)  # seq id -> its targets'
    draft_rounds: int = 0  # speculative decoding: the draft model's forwards this step (worker/runner/speculative/draft_model.py)
    draft_seconds: float = 0.0  # and the time they took
    # embeddings: seq id -> (the sum of the final hidden states of positions pool_from.. of its chunk, how
    # many) for "mean", (the prompt's last position's, 1) for "last" once the chunk reaches it
    pooled: Mapping[int, tuple[list[float], int]] = field(default_factory=dict)


@dataclass
class StepBuilder:
    """What one ``schedule`` call has decided so far; ``build`` freezes it into a StepPlan."""

    budget: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: int = 0
    prefill: object = None  # under max_step_ms, the step's time for prefill chunks (step_time.PrefillBudget)
    prefill_turns: dict = field(default_factory=dict)  # ... and per priority, the running prompts still to ask for theirs

    def build(self, block_size: int, ended: tuple[tuple[str, ...], tuple[int, ...]] = ((), ()),
              tier: TierMoves = NO_TIER_MOVES) -> StepPlan:
        """``ended``: the requests ended and the sequences dropped since the last plan."""
        return StepPlan(tuple(self.seqs), block_size, tuple(self.copies), tuple(self.swap_out),
                        tuple(self.swap_in), self.preempted, ended[0], tier, ended[1])
