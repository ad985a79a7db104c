"""Applying a step's results to the requests (the first half of ``Scheduler.update``).

Sampled tokens: computed counts advance, full blocks are published to the prefix cache (and,
under a sliding window, blocks no query will read again are released), ``n > 1``
(and ``best_of``) requests fork once their prompt is done, token-level stops end sequences.
Beam search: each new beam extends a parent beam; the first child of a parent takes the parent's
sequence, further children fork it (shared blocks, copy-on-write), and parents nobody extends are
dropped with their blocks. A finished search replaces the beams by its best hypotheses.
A step that ran ahead (``run_ahead.py``) had its positions' half applied when it was launched
(``run_ahead``); its tokens replace their placeholders here.
"""

from __future__ import annotations

import math

from pagedserve.worker.core.scheduling.config import SchedulerConfig
from pagedserve.worker.core.scheduling.plan import BeamStep, SampledToken, StepPlan, StepResult
from pagedserve.worker.core.scheduling.request import FinishReason, Request, Sequence
from pagedserve.worker.core.scheduling.request_table import RequestTable
from pagedserve.worker.core.scheduling.run_ahead import PLACEHOLDER
from pagedserve.worker.core.speculative.config import SpecStats


class StepApplier:
    def __init__(self, table: RequestTable, eos_token_ids: frozenset[int], config: SchedulerConfig) -> None:
        self.table = table
        self.eos_token_ids = eos_token_ids
        self.config = config
        self.spec_stats = SpecStats()
        self._placeholders: list[Sequence] = []  # the sequences run_ahead gave a placeholder token, in order

    def run_ahead(self, plan: StepPlan) -> None:
        """The plan's rows moved on before their tokens are in (``run_ahead.py``): computed, published,
        windows released, and a placeholder for each sampled token, which ``apply(..., ahead=True)``
        takes out again."""
        for item in plan.seqs:
            seq = self.table.seq(item.seq_id)
            if seq is None or seq.finished:
                continue
            self._computed(self.table.owner(item.seq_id), seq, item)
            if item.num_samples:
                seq.token_ids.append(PLACEHOLDER)
                self._placeholders.append(seq)

    def apply(self, plan: StepPlan, result: StepResult, ahead: bool = False) -> list[Request]:
        """The requests that got tokens or ended, in plan order (those ended outside ``update`` first);
        ``ahead``: the plan ran ahead (its rows are computed already; their tokens replace the placeholders)."""
        touched: dict[str, Request] = {r.request_id: r for r in self.table.ended_outside_update}
        self.table.ended_outside_update.clear()
        if ahead:
            self._take_placeholders()
        for item in plan.seqs:
            seq = self.table.seq(item.seq_id)
            if seq is None or seq.finished:
                continue  # aborted after it was scheduled
            req = self.table.owner(item.seq_id)
            if item.num_draft:
                self._apply_drafted(req, seq, item, result.samples[item.seq_id])
                self.table.blocks.release_outside_windows(seq.seq_id, seq.num_computed)
                touched[req.request_id] = req
                continue
            if not ahead:
                self._computed(req, seq, item)
            if item.prompt_targets:
                _record_prompt_logprobs(req, item.start, result.prompt_logprobs[item.seq_id])
            if item.pool_from is not None:  # an embedding: no token; it ends once its prompt is in
                _record_pooled(req, item, result.pooled.get(item.seq_id))
                if seq.num_computed >= seq.prompt_len:
                    self.table.finish_seq(seq.seq_id, FinishReason.STOP)
                    touched[req.request_id] = req
                continue
            if item.num_samples == 0 or req.params.use_beam_search:
                continue  # beam requests take their next tokens from ``result.beams``
            tokens = list(result.samples[item.seq_id])
            if len(tokens) != item.num_samples:
                raise ValueError(f"seq {item.seq_id}: expected {item.num_samples} samples, got {len(tokens)}")
            targets = [seq] + (self.table.fork(req, seq, len(tokens) - 1) if req.needs_fork else [])
            for target, token in zip(targets, tokens):
                self._append(req, target, token)
            touched[req.request_id] = req
        for request_id, step in result.beams.items():
            req = self.table.requests.get(request_id)
            if req is not None:  # else aborted while its beams ran
                self._beam_step(req, step)
                touched[request_id] = req
        return list(touched.values())

    def _computed(self, req: Request, seq: Sequence, item) -> None:
        """The row's KV is in: the computed count advances, full blocks are published, blocks out of
        every sliding window go back (positions only: no token of this step is read)."""
        seq.num_computed += item.num_tokens
        key = self.config.prefix_key(req.extra_key, seq.num_tokens)  # before this step's token is appended
        if req.params.pooling is None:  # an embedding's KV is not kept after it: its blocks go back uncached
            self._publish(req, seq, key)
        # a sliding lane's next query is at num_computed and sees positions > it - W
        self.table.blocks.release_outside_windows(seq.seq_id, seq.num_computed)

    def _take_placeholders(self) -> None:
        """Each placeholder ``run_ahead`` appended, out again (a sequence ended since keeps none)."""
        for seq in self._placeholders:
            if seq.token_ids[-1] != PLACEHOLDER:
                raise ValueError(f"seq {seq.seq_id}: its placeholder is gone (a token was appended after it)")
            seq.token_ids.pop()
        self._placeholders.clear()

    def _apply_drafted(self, req: Request, seq: Sequence, item, tokens: tuple[SampledToken, ...]) -> None:
        """Speculative decoding: the drafts the runner accepted (their KV is computed) and its own
        next token, each appended as a step of its own would (stops included: a stop inside the run
        ends it there); the rejected drafts' slots go back (a block left empty to the pool)."""
        if not 1 <= len(tokens) <= item.num_draft + 1:
            raise ValueError(f"seq {item.seq_id}: {len(tokens)} tokens for a draft of {item.num_draft}")
        self.spec_stats.record(item.num_draft, len(tokens) - 1, req.params.greedy)
        if seq.draft_pace is not None:
            seq.draft_pace.checked(item.num_draft, len(tokens) - 1)
        self.table.blocks.rewind(seq.seq_id, item.start + len(tokens))  # the row's own token and the accepted drafts
        if item.draft_context is not None:  # the draft model took in the row's token and its drafts but the last
            seq.draft_computed = item.start + min(len(tokens), item.num_draft)
        seq.num_computed = item.start + 1
        key = self.config.prefix_key(req.extra_key, seq.num_tokens)
        self._publish(req, seq, key)  # as a plain step would, before a stop in the run frees the blocks
        for index, token in enumerate(tokens):
            self._append(req, seq, token)
            if seq.finished:
                return
            if index < len(tokens) - 1:
                seq.num_computed += 1  # an accepted draft: its KV was computed this step
        self._publish(req, seq, key)

    def _publish(self, req: Request, seq: Sequence, key) -> None:
        """Register the seq's full, computed blocks in the prefix cache under ``key``'s salt."""
        self.table.blocks.register_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed, key,
                                               req.prompt_hashes(self.config.block_size, key))

    def _append(self, req: Request, seq: Sequence, token: SampledToken) -> None:
        seq.token_ids.append(token.token_id)
        if token.logprob is not None:
            seq.cumulative_logprob += token.logprob
        if req.params.logprobs is not None:
            seq.logprobs.append(token)
        reason = seq.token_stop(req.params, self.eos_token_ids)
        if seq.grammar is not None and reason is None:
            reason = _grammar_stop(seq.grammar, token.token_id)
        if reason is not None:
            self.table.finish_seq(seq.seq_id, reason)

    def _beam_step(self, req: Request, step: BeamStep) -> None:
        if step.results is not None:
            self._finish_beams(req, step.results)
        else:
            self._apply_beams(req, step.choices)

    def _apply_beams(self, req: Request, choices: tuple[tuple[int, int], ...]) -> None:
        """Next running beams as ``(parent seq id, token)``, best first."""
        parents = {s.seq_id: s for s in req.live_seqs}
        used: set[int] = set()
        targets = []
        for parent_id, token in choices:  # forks first, so children copy the parent before it grows
            target = parents[parent_id] if parent_id not in used else self.table.fork(req, parents[parent_id], 1)[0]
            used.add(parent_id)
            targets.append((target, token))
        for seq_id in parents.keys() - used:
            self.table.drop_seq(req, parents[seq_id])
        for target, token in targets:
            target.token_ids.append(token)
        req.seqs = [t for t, _ in targets]
        req.forked = True

    def _finish_beams(self, req: Request, results) -> None:
        """End a beam-search request with its best hypotheses as the outputs."""
        for seq in list(req.live_seqs):
            self.table.drop_seq(req, seq)
        outputs = []
        for index, (tokens, score) in enumerate(results):
            tokens = list(tokens)
            seq = Sequence(-1 - index, req.prompt_ids + tokens, len(req.prompt_ids), index=index, cumulative_logprob=score)
            seq.finish_reason = FinishReason.STOP if tokens and tokens[-1] in self.eos_token_ids else FinishReason.LENGTH
            outputs.append(seq)
        req.seqs = outputs
        self.table.finish_request(req, FinishReason.STOP, None)


def _grammar_stop(grammar, token: int) -> FinishReason | None:
    """The grammar consumes the token: STOP once it is complete, ERROR if the token broke it
    (the sampler's mask allows only tokens it accepts, so that is a bug, never a silent cut)."""
    if not grammar.consume_token(token):
        return FinishReason.ERROR
    return FinishReason.STOP if grammar.is_stopped() else None


def _record_pooled(req: Request, item, pooled: tuple[list[float], int] | None) -> None:
    """Add a chunk's pooled hidden states (positions from ``item.pool_from``: a prompt computed again
    after a preemption is not counted twice); at the prompt's end, the embedding: the mean (or the
    last position's state), normalised to unit length."""
    if pooled is not None:
        values, count = pooled
        if req.params.pooling == "last":
            req.pooled, req.pooled_upto = list(values), item.context_len
        else:
            req.pooled = values if req.pooled is None else [a + b for a, b in zip(req.pooled, values)]
            req.pooled_upto += count
    if item.context_len >= len(req.prompt_ids) and req.pooled is not None:  # a sum's direction is its mean's
        norm = math.sqrt(sum(v * v for v in req.pooled)) or 1.0
        req.embedding = [v / norm for v in req.pooled]


def _record_prompt_logprobs(req: Request, start: int, entries: tuple[SampledToken, ...]) -> None:
    """Keep the entries of prompt positions not recorded yet (a prompt computed again after a
    preemption gives them a second time). Entry k is position k + 1's token."""
    skip = len(req.prompt_logprobs) - start
    if skip < 0:
        raise ValueError(f"request {req.request_id}: prompt logprobs from position {start + 1}, "
                         f"{len(req.prompt_logprobs)} recorded")
    req.prompt_logprobs.extend(entries[skip:])
