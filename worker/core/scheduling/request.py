"""Engine-side request state: a Request is a group of Sequences that share a prompt.

These are in-memory engine types; the wire types live in shared/protocol.py.
A request with ``n > 1`` holds one sequence until its prompt is prefilled, then forks.
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Hashable

from pagedserve.shared.block_hash import prefix_hashes
from pagedserve.shared.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # no blocks (new, or preempted by recompute)
    RUNNING = "running"  # blocks on the GPU
    SWAPPED = "swapped"  # blocks on the CPU
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(eq=False)
class Sequence:
    """One output stream: prompt + generated tokens, and how many of them have KV computed."""

    seq_id: int
    token_ids: list[int]
    prompt_len: int
    index: int = 0  # position among the request's n outputs
    num_computed: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (vLLM's), else None
    logprobs: list = field(default_factory=list)  # one entry per output token when asked
    cumulative_logprob: float = 0.0
    grammar: object = None  # this sequence's GrammarState (worker.core.grammar) when the output is constrained
    draft_pace: object = None  # speculative decoding: its DraftPace (worker.core.speculative), once it drafted
    draft_computed: int = 0  # a draft model's KV is valid for positions before this (0 after preemption)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def token_stop(self, params: SamplingParams, eos_token_ids: frozenset[int]) -> FinishReason | None:
        """The reason the last appended token ends this sequence, judged on token ids alone."""
        if self.num_output < params.min_tokens:
            return None
        last = self.token_ids[-1]
        if last in params.stop_token_ids:
            self.stop_reason = last
            return FinishReason.STOP
        if not params.ignore_eos and last in eos_token_ids:
            return FinishReason.STOP
        if self.num_output >= params.max_tokens:
            return FinishReason.LENGTH
        return None


@dataclass(eq=False)
class Request:
    """A sequence group: one prompt, ``params.n`` outputs, scheduled and preempted as a unit."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    order: int  # tie-breaker: submission order
    priority: int = 0  # lower runs first
    deadline: float | None = None  # absolute time on the scheduler's clock
    extra_key: Hashable = None  # prefix-cache salt (e.g. a tenant id; with an adapter, its key too)
    adapter: str | None = None  # the LoRA adapter it runs under (worker/runner/lora/); None: the base model
    seqs: list[Sequence] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    forked: bool = False
    error: str | None = None
    resumed: int = 0  # output tokens a client already had when this request was re-sent (Resume)
    first_scheduled: float | None = None  # when it first ran, on the scheduler's clock (queue time)
    cached_tokens: int | None = None  # prompt tokens the prefix cache served when it first ran (tiers' among them)
    tier_cached_tokens: int = 0  # of those, the ones copied up from the host or disk tier
    grammar: Future | None = None  # the compiled constraint (a pristine GrammarState) while it is built
    prompt_logprobs: list = field(default_factory=list)  # with params.prompt_logprobs: prompt positions 1.. so far
    pooled: list[float] | None = None  # with params.pooling: the pooled final hidden states so far (a sum for "mean")
    pooled_upto: int = 0  # and the prompt positions they cover
    embedding: list[float] | None = None  # once the prompt is in: the pooled vector, normalised
    _prompt_hashes: dict = field(default_factory=dict, repr=False)  # salt -> the prompt's block-hash chain

    def prompt_hashes(self, block_size: int, salt: Hashable) -> list[int]:
        """The prompt's block-hash chain under ``salt`` (``shared/block_hash.py``), computed once and
        kept: the scheduler matches it against the prefix cache every step the request waits, and
        its blocks are registered under it once computed."""
        chain = self._prompt_hashes.get(salt)
        if chain is None:
            chain = self._prompt_hashes[salt] = prefix_hashes(self.prompt_ids, block_size, salt)
        return chain

    @property
    def grammar_ready(self) -> bool:
        return self.grammar is None or self.grammar.done()

    @property
    def sort_key(self) -> tuple[int, float, int]:
        return (self.priority, self.arrival, self.order)

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    @property
    def prefilling(self) -> bool:
        """A live sequence still has more than its next token to compute (its prompt, or what a
        preemption dropped): it takes a prefill chunk, not a decoding row."""
        return any(s.num_uncomputed > 1 for s in self.live_seqs)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def seq_slots(self) -> int:
        """Batch slots the request needs once forked; reserved from admission on."""
        return len(self.live_seqs) if self.forked else self.params.num_seqs

    @property
    def needs_fork(self) -> bool:
        return self.params.num_seqs > 1 and not self.forked and not self.params.use_beam_search
