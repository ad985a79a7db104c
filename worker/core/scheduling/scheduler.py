"""Continuous batching: every step decides which sequences compute how many tokens.

Order of a step (``schedule``):

1. Requests past their deadline are aborted.
2. Running requests, most important first (lower ``priority``, then earlier arrival), get their
   decode token or next prefill chunk under the token budget. When blocks run out, the least
   important running request is preempted (recompute: blocks freed, requeued; swap: blocks moved
   to the CPU pool); if none is left to preempt, the request itself is.
3. If nothing was preempted, swapped requests come back in, then waiting requests are admitted
   (taking prefix-cache hits) while budget, ``max_num_seqs`` and blocks last.

``update(plan, result)`` applies what the runner returned (tokens, beam steps: step_apply.py) and
turns the touched requests into outputs (detokenization, stop strings: output_builder.py). The
requests, their sequences and the queues live in ``RequestTable``. No I/O and no torch.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence as Seq

from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.core.kv_cache.block_manager import BlockManager
from pagedserve.worker.core.kv_cache.prefix_hit import NO_HIT, PrefixHit
from pagedserve.worker.core.kv_cache.kv_events import KvEvents
from pagedserve.worker.core.kv_cache.tiers import KvTiers
from pagedserve.worker.core.scheduling.admission import admission, prompts_to_finish, start_request
from pagedserve.worker.core.scheduling.config import SchedulerConfig
from pagedserve.worker.core.scheduling.detokenizer import Detokenizer
from pagedserve.worker.core.scheduling.drafts import NO_DRAFT, Draft, row_draft
from pagedserve.worker.core.scheduling.output_builder import OutputBuilder
from pagedserve.worker.core.scheduling.outputs import RequestOutput
from pagedserve.worker.core.scheduling.plan import ScheduledSeq, StepBuilder, StepPlan, StepResult
from pagedserve.worker.core.scheduling.request import FinishReason, Request, RequestStatus, Sequence
from pagedserve.worker.core.scheduling.request_table import RequestTable
from pagedserve.worker.core.scheduling.run_ahead import PLACEHOLDER
from pagedserve.worker.core.scheduling.step_apply import StepApplier
from pagedserve.worker.core.scheduling.step_time import (MIN_PREFILL, PREFILLING_AT_ONCE, PrefillBudget, StepSeconds,
                                                          StepTime)
from pagedserve.worker.core.scheduling.structured_state import grammar_error, start_state
from pagedserve.worker.core.speculative.draft_cost import StepCost


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    cow_copies: int = 0  # copy-on-write block copies (a shared block written by one of its sequences)
    rope_recomputes: int = 0  # long-rope sequences recomputed as they grew past the switch length
    tier_hit_tokens: int = 0  # prefix-hit tokens copied up from the host or disk tier (kv_tiers.py)
    step_seconds: StepSeconds = field(default_factory=StepSeconds)  # every step's time (Engine.step feeds it)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        eos_token_ids: frozenset[int] = frozenset(),
        clock: Callable[[], float] = time.monotonic,
        detokenizer: Detokenizer | None = None,
        tiers: KvTiers | None = None,
    ) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.blocks = BlockManager(
            config.num_gpu_blocks, config.block_size, config.num_cpu_blocks, config.enable_prefix_caching, tiers,
            config.lane_windows,
        )
        self.waits_on_disk = False  # the last schedule left a request waiting for its prefix from disk
        self.table = RequestTable(self.blocks)
        # The table's containers, under the names the scheduling policy reads (never rebound).
        self.requests, self.waiting = self.table.requests, self.table.waiting
        self.running, self.swapped = self.table.running, self.table.swapped
        self.stats = SchedulerStats()
        self.applier = StepApplier(self.table, self.eos_token_ids, config)
        self.step_cost = StepCost() if config.speculative else None  # what a drafted token costs (Engine.step feeds it)
        self.step_time = StepTime() if config.max_step_ms else None  # what a step costs in time (Engine.step feeds it)
        self.outputs = OutputBuilder(self.table, detokenizer)
        self._orders = itertools.count()

    # ------------------------------------------------------------------ requests in and out
    def add(
        self,
        request_id: str,
        prompt_ids: Seq[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        deadline: float | None = None,
        extra_key: Hashable = None,
        resume_output: Seq[int] = (),
        grammar: Future | None = None,
        adapter: str | None = None,
    ) -> Request:
        """Queue a request. Raises InvalidRequestError if it could never be served.

        ``resume_output``: output tokens already sent by a worker that died; the request goes on
        after them (prefilled with the prompt, like a request preempted by recompute). ``grammar``:
        the compiled constraint of a structured request, which waits until it is done. ``adapter``:
        the LoRA adapter its rows run under (the caller salts ``extra_key`` with it)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight", "id")
        self.config.check_fits(len(prompt_ids), params)
        req = Request(
            request_id, list(prompt_ids), params, arrival=self.clock(), order=next(self._orders),
            priority=priority, deadline=deadline, extra_key=extra_key, resumed=len(resume_output), grammar=grammar,
            adapter=adapter,
        )
        self.table.new_seq(req, list(prompt_ids) + list(resume_output), index=0)
        self.requests[request_id] = req
        self.waiting.append(req)
        return req

    def abort(self, request_id: str, error: str | None = None) -> bool:
        """Finish a request in any state and free its blocks. False if it is unknown or done."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.table.end_outside_update(req, FinishReason.ERROR if error else FinishReason.ABORT, error)
        return True

    def finish_seq(self, seq_id: int, reason: FinishReason) -> None:
        """End one sequence (e.g. a stop string found outside the engine)."""
        self.table.finish_seq(seq_id, reason)

    def update(self, plan: StepPlan, result: StepResult, ahead: bool = False) -> list[RequestOutput]:
        """Apply the runner's result to the plan's requests; their outputs, in plan order. ``ahead``:
        ``run_ahead(plan)`` was called when it was launched."""
        return self.outputs.build(self.applier.apply(plan, result, ahead))

    def run_ahead(self, plan: StepPlan) -> None:
        """Move ``plan``'s rows on before their tokens are in, so the next step can be planned while
        it runs (``run_ahead.py``; only where ``can_run_ahead(plan)``)."""
        self.applier.run_ahead(plan)

    @property
    def has_work(self) -> bool:
        return bool(self.requests or self.table.ended_outside_update)

    def record_kv_events(self, events: KvEvents | None) -> None:
        """Tell ``events`` each hash the prefix cache gains or loses (None: stop)."""
        self.blocks.record_kv_events(events)

    def cached_hashes(self) -> list[int]:
        return self.blocks.gpu.published_hashes()

    def lowered_hashes(self) -> list[int]:
        return self.blocks.lowered_hashes()

    def forget_cached(self) -> None:
        """Empty the prefix cache (blocks in use stay)."""
        self.blocks.gpu.forget_cached()

    def compiling(self) -> list[Future]:
        """Grammars that waiting requests wait for."""
        return [r.grammar for r in self.waiting if not r.grammar_ready]

    @property
    def num_running_seqs(self) -> int:
        return sum(r.seq_slots for r in self.running)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> StepPlan:
        self._expire_deadlines()
        step = StepBuilder(budget=self.config.max_num_batched_tokens, prefill=self._prefill_budget(),
                           prefill_turns=self._prefill_turns())
        self.waits_on_disk = False
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_swapped(step)
        if not step.preempted and not self.swapped:
            self._schedule_waiting(step)
        return step.build(self.config.block_size, self.table.take_ended_ids(), self.blocks.take_tier_moves())

    def _expire_deadlines(self) -> None:
        now = self.clock()
        for req in list(self.requests.values()):
            if req.deadline is not None and now >= req.deadline:
                self.table.end_outside_update(req, FinishReason.ABORT, "deadline exceeded")

    def _chunk_sizes(self, req: Request, step: StepBuilder) -> list[tuple[int, int]]:
        """(seq_id, tokens) for each live seq, taking from the step's budget in order (a prefill
        chunk also within its time, ``_timed``)."""
        sizes, budget = [], step.budget
        turns = step.prefill_turns.get(req.priority, 0) if req.prefilling else 0
        if turns:  # a running prompt asks once a step
            step.prefill_turns[req.priority] = turns - 1
        for seq in req.live_seqs:
            if seq.token_ids[-1] == PLACEHOLDER and seq.num_output >= req.params.max_tokens:
                continue  # its token running ahead is its last: no row after it (run_ahead.py)
            count = self._timed(step, seq.num_computed, min(seq.num_uncomputed, budget), turns)
            budget -= count
            sizes.append((seq.seq_id, count))
        return sizes

    def _prefill_turns(self) -> dict[int, int]:
        """Under ``max_step_ms``: per priority, the running requests whose prompt is not in yet.
        They share the step's prefill budget (tokens and time) instead of the first taking all of
        it: each asks for an equal part of what is left when it asks (``_timed``), so one that
        needs less leaves the rest to those after it; a higher priority still asks first."""
        turns: dict[int, int] = {}
        if self.step_time is not None:
            for req in self.running:
                if req.prefilling:
                    turns[req.priority] = turns.get(req.priority, 0) + 1
        return turns

    def _prefill_budget(self) -> PrefillBudget | None:
        """Under ``max_step_ms``, the step's time for prefill chunks beside its decoding rows."""
        if self.step_time is None:
            return None
        starts = [s.num_computed for r in self.running for s in r.live_seqs if s.num_uncomputed == 1]
        return PrefillBudget.beside(self.step_time, self.config.max_step_ms, starts)

    @staticmethod
    def _timed(step: StepBuilder, start: int, count: int, turns: int = 0) -> int:
        """A prefill chunk cut to the step's time (``PrefillBudget.cut``), as is without a target;
        with ``turns`` prompts of its priority still to ask (itself included), to its equal part
        of the tokens left, and of the time."""
        if step.prefill is None:
            return count
        if turns > 1 and count > 1:
            count = min(count, max(MIN_PREFILL, -(-step.budget // turns)))  # its part of the tokens left
        return step.prefill.cut(start, count, max(turns, 1))

    def _schedule_running(self, step: StepBuilder) -> None:
        self.running.sort(key=lambda r: r.sort_key)
        queue = list(self.running)
        share, rows, blind = 0.0, sum(len(r.live_seqs) for r in queue), False
        if self.step_cost is not None:  # what a drafted token costs in a step of this many rows
            share, blind = self.step_cost.share(rows)
        while queue and step.budget > 0:
            req = queue.pop(0)
            if self._crossed_rope_switch(req):
                continue
            sizes = self._chunk_sizes(req, step)
            draft = self._draft(req, sizes, step.budget, share, blind)
            if draft:  # only into free blocks: a draft never preempts anyone
                drafted = [(seq_id, count + len(draft.tokens)) for seq_id, count in sizes]
                if self.blocks.cost_to_grow(drafted) <= self.blocks.num_free_blocks:
                    sizes = drafted
                else:
                    draft = None
            while self.blocks.cost_to_grow(sizes) > self.blocks.num_free_blocks:
                victim = queue.pop() if queue else req
                self._preempt(victim, step)
                if victim is req:
                    break
            else:
                self._emit(req, sizes, step, draft or NO_DRAFT)

    def _draft(self, req: Request, sizes: list[tuple[int, int]], budget: int, share: float, blind: bool) -> Draft | None:
        """Speculative decoding: a one-sequence request's draft (``worker/core/scheduling/drafts.py``)."""
        if self.config.speculative is None or len(sizes) != 1:
            return None
        (seq_id, count), = sizes
        return row_draft(self.config, req, self.table.seq(seq_id), count, budget, share, self.applier.spec_stats.lately, blind)

    def _crossed_rope_switch(self, req: Request) -> bool:
        """Long-rope: a sequence that grew past ``rope_switch`` holds KV rotated with the short
        factors, which transformers recomputes with the long ones at that point; so is the
        request here (back to the waiting queue, as a recompute preemption, without counting one)."""
        switch = self.config.rope_switch
        if not switch or not any(0 < s.num_computed <= switch < s.num_tokens for s in req.live_seqs):
            return False
        self.running.remove(req)
        self._recompute(req)
        self.stats.rope_recomputes += 1
        return True

    def _schedule_swapped(self, step: StepBuilder) -> None:
        self.swapped.sort(key=lambda r: r.sort_key)
        for req in list(self.swapped):
            if not self._adapter_fits(req):
                continue
            ids = [s.seq_id for s in req.live_seqs]
            sizes = self._chunk_sizes(req, step)
            cost = self.blocks.swap_in_cost(ids) + self.blocks.cost_to_grow(sizes)
            if not self._may_start(req, step) or cost > self.blocks.num_free_blocks:
                return
            step.swap_in.extend(self.blocks.swap_in(ids))
            self.swapped.remove(req)
            self._run(req)
            self._emit(req, sizes, step)

    def _match(self, req: Request, seq: Sequence) -> PrefixHit:
        salt = self.config.prefix_key(req.extra_key, seq.num_tokens)
        return self.blocks.match_prefix(seq.token_ids, salt, req.prompt_hashes(self.config.block_size, salt))

    def _schedule_waiting(self, step: StepBuilder) -> None:
        """Admit waiting requests in order while the budget, ``max_num_seqs`` and the blocks last: a
        request starts only when its first chunk fits and, beside running requests, its whole
        prompt fits in what their prompts leave (``admission.py``)."""
        self.waiting.sort(key=lambda r: r.sort_key)
        reserved = prompts_to_finish(self.blocks, self.config, self.running)
        for req in list(self.waiting):
            if not req.grammar_ready:
                continue  # compiling off the loop: later requests may start meanwhile
            if not self._adapter_fits(req):
                continue  # its adapter would be one too many: later requests may start meanwhile
            if not self._may_start(req, step):
                return
            if not self._start_grammar(req):
                continue
            computed_in_full = req.params.prompt_logprobs is not None or req.params.pooling is not None
            hits = {s.seq_id: NO_HIT if computed_in_full else self._match(req, s) for s in req.live_seqs}
            if any(hit.waits_on_disk for hit in hits.values()):
                self.waits_on_disk = True
                continue  # its prefix is being read from disk: later requests run meanwhile
            taken = admission(self.blocks, self.config, req, hits, step.budget,
                              lambda start, count: self._timed(step, start, count))
            if taken.now > self.blocks.num_free_blocks:
                return
            if self.running and reserved + taken.whole > self.blocks.num_free_blocks:
                return
            reserved += max(0, taken.whole - taken.now)
            asked, hit, below = start_request(self.blocks, req, taken)
            self.stats.prefix_query_tokens += asked
            self.stats.prefix_hit_tokens += hit
            self.stats.tier_hit_tokens += below
            self.waiting.remove(req)
            self._run(req)
            self._emit(req, taken.sizes, step)

    def _start_grammar(self, req: Request) -> bool:
        """Give each sequence its grammar state (first start only); False when it failed to compile."""
        if req.grammar is None:
            return True
        error = grammar_error(req.grammar)
        if error is not None:
            self.table.end_outside_update(req, FinishReason.ERROR, error)
            return False
        for seq in req.live_seqs:
            if seq.grammar is None:
                seq.grammar = start_state(req.grammar.result(), seq.output_ids)
        return True

    def _adapter_fits(self, req: Request) -> bool:
        """Whether ``req`` may run beside the running requests without more than ``max_loras``
        adapters among them (the runner keeps that many on the device)."""
        cap = self.config.max_loras
        if not cap or req.adapter is None:
            return True
        active = {r.adapter for r in self.running if r.adapter is not None}
        return req.adapter in active or len(active) < cap

    def _may_start(self, req: Request, step: StepBuilder) -> bool:
        """Within the token budget and ``max_num_seqs``; under ``max_step_ms`` beside decoding rows, once
        the step's prefill time is spent, only beside fewer than ``PREFILLING_AT_ONCE`` prompts of its
        priority or a higher one (a burst starts a few at a time, in order, instead of every prompt
        taking a sliver of each step; a more urgent prompt still starts at once)."""
        if step.budget <= 0 or self.num_running_seqs + req.seq_slots > self.config.max_num_seqs:
            return False
        return (step.prefill is None or not step.prefill.spent
                or sum(1 for r in self.running if r.prefilling and r.priority <= req.priority) < PREFILLING_AT_ONCE)

    def _run(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        if req.first_scheduled is None:
            req.first_scheduled = self.clock()
        self.running.append(req)

    def _emit(self, req: Request, sizes: list[tuple[int, int]], step: StepBuilder, draft: Draft = NO_DRAFT) -> None:
        """Grow the seqs' tables (a draft's slots too: one sequence's) and add their work to the step."""
        for seq_id, count in sizes:
            if count <= 0:
                continue
            seq = self.table.seq(seq_id)
            copies = self.blocks.grow(seq_id, count)
            self.stats.cow_copies += len(copies)
            step.copies.extend(copies)
            step.seqs.append(self._scheduled(req, seq, count - len(draft.tokens), draft))
            step.budget -= count

    def _scheduled(self, req: Request, seq: Sequence, count: int, draft: Draft = NO_DRAFT) -> ScheduledSeq:
        """The work and everything the runner needs to sample it, without asking back; a draft's
        tokens follow the row's own (the runner checks them)."""
        p, start = req.params, seq.num_computed
        samples = 0
        if start + count == seq.num_tokens:
            samples = p.num_seqs if req.needs_fork else 1
        history = samples and (p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty)
        table_from, (table, *lanes) = self.blocks.table_change(seq.seq_id)  # what the runner does not hold yet
        return ScheduledSeq(
            seq.seq_id, req.request_id, tuple(seq.token_ids[start : start + count]) + draft.tokens, start,
            table, samples, p, seq.index, seq.num_output,
            tuple(req.prompt_ids) if history else (), tuple(seq.output_ids) if history else (),
            tuple(s.seq_id for s in req.live_seqs) if p.use_beam_search else (),
            seq.grammar if samples else None, seq.num_tokens, self._prompt_targets(req, seq, start, count),
            len(draft.tokens), draft.grammars, draft.draft_context, req.pooled_upto if p.pooling else None, req.adapter,
            tuple(lanes), table_from,
        )

    @staticmethod
    def _prompt_targets(req: Request, seq: Sequence, start: int, count: int) -> tuple[int, ...]:
        """prompt_logprobs: the prompt tokens that positions ``start..`` of this chunk predict."""
        if req.params.prompt_logprobs is None or seq.index != 0 or start + 1 >= seq.prompt_len:
            return ()
        return tuple(req.prompt_ids[start + 1 : min(start + count + 1, seq.prompt_len)])

    def _preempt(self, req: Request, step: StepBuilder) -> None:
        ids = [s.seq_id for s in req.live_seqs]
        for seq in req.live_seqs:
            seq.draft_computed = 0  # its blocks go (or move, without the draft model's KV)
        self.running.remove(req)
        step.preempted += 1
        self.stats.num_preemptions += 1
        if self.config.preemption_mode == "swap" and self.blocks.swap_out_cost(ids) <= self.blocks.cpu.num_free:
            step.swap_out.extend(self.blocks.swap_out(ids))
            req.status = RequestStatus.SWAPPED
            self.swapped.append(req)
            return
        self._recompute(req)

    def _recompute(self, req: Request) -> None:
        """Drop the request's KV; it waits to be prefilled again (prefix-cache hits included)."""
        for seq in req.live_seqs:
            self.blocks.free(seq.seq_id)
            seq.num_computed = 0
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
