"""Continuous batching: every step decides which sequences compute how many tokens.

Order of a step (``schedule``):

1. Requests past their deadline are aborted.
2. Running requests, most important first (lower ``priority``, then earlier arrival), get their
   decode token or next prefill chunk under the token budget. When blocks run out, the least
   important running request is preempted (recompute: blocks freed, requeued; swap: blocks moved
   to the CPU pool); if none is left to preempt, the request itself is.
3. If nothing was preempted, swapped requests come back in, then waiting requests are admitted
   (taking prefix-cache hits) while budget, ``max_num_seqs`` and blocks last.

``update`` (worker/step_results.py) applies the sampled tokens. No I/O and no torch.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence as Seq

from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams
from worker.block_manager import BlockManager
from worker.config import SchedulerConfig
from worker.plan import ScheduledSeq, StepBuilder, StepPlan
from worker.request import FinishReason, Request, RequestStatus, Sequence
from worker.step_results import StepResults


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0


class Scheduler(StepResults):
    def __init__(
        self,
        config: SchedulerConfig,
        eos_token_ids: frozenset[int] = frozenset(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.blocks = BlockManager(
            config.num_gpu_blocks, config.block_size, config.num_cpu_blocks, config.enable_prefix_caching
        )
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._seqs: dict[int, Sequence] = {}
        self._owner: dict[int, Request] = {}
        self._seq_ids = itertools.count()
        self._orders = itertools.count()
        self._finished_outside_update: list[Request] = []

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
    ) -> Request:
        """Queue a request. Raises InvalidRequestError if it could never be served."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight", "id")
        self.config.check_fits(len(prompt_ids), params)
        req = Request(
            request_id, list(prompt_ids), params, arrival=self.clock(), order=next(self._orders),
            priority=priority, deadline=deadline, extra_key=extra_key,
        )
        self._new_seq(req, list(prompt_ids), index=0)
        self.requests[request_id] = req
        self.waiting.append(req)
        return req

    def _new_seq(self, req: Request, token_ids: list[int], index: int) -> Sequence:
        seq = Sequence(next(self._seq_ids), token_ids, len(req.prompt_ids), index=index)
        req.seqs.append(seq)
        self._seqs[seq.seq_id] = seq
        self._owner[seq.seq_id] = req
        return seq

    def abort(self, request_id: str, error: str | None = None) -> bool:
        """Finish a request in any state and free its blocks. False if it is unknown or done."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish_request(req, FinishReason.ERROR if error else FinishReason.ABORT, error)
        self._finished_outside_update.append(req)
        return True

    def finish_seq(self, seq_id: int, reason: FinishReason) -> None:
        """End one sequence (e.g. a stop string found by the detokenizer)."""
        seq = self._seqs[seq_id]
        if seq.finished:
            return
        seq.finish_reason = reason
        self.blocks.free(seq_id)
        req = self._owner[seq_id]
        if not req.live_seqs:
            self._finish_request(req, reason, None)

    def _finish_request(self, req: Request, reason: FinishReason, error: str | None) -> None:
        for seq in req.seqs:
            if not seq.finished:
                seq.finish_reason = reason
            self.blocks.free(seq.seq_id)
            self._seqs.pop(seq.seq_id, None)
            self._owner.pop(seq.seq_id, None)
        for queue in (self.waiting, self.running, self.swapped):
            if req in queue:
                queue.remove(req)
        req.status, req.error = RequestStatus.FINISHED, error
        self.requests.pop(req.request_id, None)

    def seq(self, seq_id: int) -> Sequence:
        return self._seqs[seq_id]

    def owner(self, seq_id: int) -> Request:
        return self._owner[seq_id]

    @property
    def has_work(self) -> bool:
        return bool(self.requests or self._finished_outside_update)

    @property
    def num_running_seqs(self) -> int:
        return sum(r.seq_slots for r in self.running)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> StepPlan:
        self._expire_deadlines()
        step = StepBuilder(budget=self.config.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_swapped(step)
        if not step.preempted and not self.swapped:
            self._schedule_waiting(step)
        return step.build(self.config.block_size)

    def _expire_deadlines(self) -> None:
        now = self.clock()
        for req in list(self.requests.values()):
            if req.deadline is not None and now >= req.deadline:
                self._finish_request(req, FinishReason.ABORT, "deadline exceeded")
                self._finished_outside_update.append(req)

    def _chunk_sizes(self, req: Request, budget: int) -> list[tuple[int, int]]:
        """(seq_id, tokens) for each live seq, taking from ``budget`` in order."""
        sizes = []
        for seq in req.live_seqs:
            count = min(seq.num_uncomputed, budget)
            budget -= count
            sizes.append((seq.seq_id, count))
        return sizes

    def _schedule_running(self, step: StepBuilder) -> None:
        self.running.sort(key=lambda r: r.sort_key)
        queue = list(self.running)
        while queue and step.budget > 0:
            req = queue.pop(0)
            sizes = self._chunk_sizes(req, step.budget)
            while self.blocks.cost_to_grow(sizes) > self.blocks.num_free_blocks:
                victim = queue.pop() if queue else req
                self._preempt(victim, step)
                if victim is req:
                    break
            else:
                self._emit(req, sizes, step)

    def _schedule_swapped(self, step: StepBuilder) -> None:
        self.swapped.sort(key=lambda r: r.sort_key)
        for req in list(self.swapped):
            ids = [s.seq_id for s in req.live_seqs]
            sizes = self._chunk_sizes(req, step.budget)
            cost = self.blocks.swap_in_cost(ids) + self.blocks.cost_to_grow(sizes)
            if not self._may_start(req, step) or cost > self.blocks.num_free_blocks:
                return
            step.swap_in.extend(self.blocks.swap_in(ids))
            self.swapped.remove(req)
            self._run(req)
            self._emit(req, sizes, step)

    def _schedule_waiting(self, step: StepBuilder) -> None:
        self.waiting.sort(key=lambda r: r.sort_key)
        for req in list(self.waiting):
            if not self._may_start(req, step):
                return
            hits = {s.seq_id: self.blocks.match_prefix(s.token_ids, req.extra_key) for s in req.live_seqs}
            reclaimed = {b for hit in hits.values() for b in hit.blocks if self.blocks.gpu.is_cached_free(b)}
            sizes, budget, new_blocks = [], step.budget, 0
            for seq in req.live_seqs:
                cached = len(hits[seq.seq_id].blocks) * self.config.block_size
                count = min(seq.num_tokens - cached, budget)
                budget -= count
                sizes.append((seq.seq_id, count))
                new_blocks += self.blocks.blocks_for(cached + count) - len(hits[seq.seq_id].blocks)
            if len(reclaimed) + new_blocks > self.blocks.num_free_blocks:
                return
            for seq in req.live_seqs:
                seq.num_computed = self.blocks.start(seq.seq_id, hits[seq.seq_id])
                self.stats.prefix_query_tokens += seq.num_tokens
                self.stats.prefix_hit_tokens += seq.num_computed
            self.waiting.remove(req)
            self._run(req)
            self._emit(req, sizes, step)

    def _may_start(self, req: Request, step: StepBuilder) -> bool:
        return step.budget > 0 and self.num_running_seqs + req.seq_slots <= self.config.max_num_seqs

    def _run(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _emit(self, req: Request, sizes: list[tuple[int, int]], step: StepBuilder) -> None:
        """Grow the seqs' tables and add their work to the step."""
        for seq_id, count in sizes:
            if count <= 0:
                continue
            seq = self._seqs[seq_id]
            step.copies.extend(self.blocks.grow(seq_id, count))
            start = seq.num_computed
            samples = 0
            if start + count == seq.num_tokens:
                samples = req.params.num_seqs if req.needs_fork else 1
            step.seqs.append(ScheduledSeq(
                seq_id, req.request_id, tuple(seq.token_ids[start : start + count]), start,
                self.blocks.block_table(seq_id), samples,
            ))
            step.budget -= count

    def _preempt(self, req: Request, step: StepBuilder) -> None:
        ids = [s.seq_id for s in req.live_seqs]
        self.running.remove(req)
        step.preempted += 1
        self.stats.num_preemptions += 1
        if self.config.preemption_mode == "swap" and self.blocks.swap_out_cost(ids) <= self.blocks.cpu.num_free:
            step.swap_out.extend(self.blocks.swap_out(ids))
            req.status = RequestStatus.SWAPPED
            self.swapped.append(req)
            return
        for seq in req.live_seqs:
            self.blocks.free(seq.seq_id)
            seq.num_computed = 0
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
