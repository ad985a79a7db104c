"""Applying a step's results to the scheduler's requests (the second half of ``Scheduler``).

``update`` advances computed counts, publishes full blocks to the prefix cache, forks ``n > 1``
(and ``best_of``) requests once their prompt is done, and checks token-level stops. Beam-search
requests get their tokens from ``apply_beams`` instead: each new beam extends a parent beam, the
first child of a parent takes the parent's sequence, further children fork it (shared blocks,
copy-on-write), and parents nobody extends are dropped with their blocks.
"""

from __future__ import annotations

from typing import Mapping, Sequence as Seq

from worker.plan import SampledToken, StepPlan
from worker.request import FinishReason, Request, Sequence


class StepResults:
    def update(self, plan: StepPlan, samples: Mapping[int, Seq[SampledToken]]) -> list[Request]:
        """Apply a step's results. Returns the requests that got tokens or finished, in plan order."""
        touched: dict[str, Request] = {r.request_id: r for r in self._finished_outside_update}
        self._finished_outside_update.clear()
        for item in plan.seqs:
            seq = self._seqs.get(item.seq_id)
            if seq is None or seq.finished:
                continue  # aborted after it was scheduled
            req = self._owner[item.seq_id]
            seq.num_computed += item.num_tokens
            self.blocks.register_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed, req.extra_key)
            if item.num_samples == 0 or req.params.use_beam_search:
                continue  # beam requests take their next tokens from BeamState, through apply_beams
            tokens = list(samples[item.seq_id])
            if len(tokens) != item.num_samples:
                raise ValueError(f"seq {item.seq_id}: expected {item.num_samples} samples, got {len(tokens)}")
            targets = [seq] + (self._fork(req, seq, len(tokens) - 1) if req.needs_fork else [])
            for target, token in zip(targets, tokens):
                self._append(req, target, token)
            touched[req.request_id] = req
        return list(touched.values())

    def _fork(self, req: Request, parent: Sequence, count: int) -> list[Sequence]:
        req.forked = True
        children = []
        for i in range(count):
            child = self._new_seq(req, list(parent.token_ids), index=i + 1)
            child.num_computed = parent.num_computed
            self.blocks.fork(parent.seq_id, child.seq_id)
            children.append(child)
        return children

    def _append(self, req: Request, seq: Sequence, token: SampledToken) -> None:
        seq.token_ids.append(token.token_id)
        if token.logprob is not None:
            seq.cumulative_logprob += token.logprob
        if req.params.logprobs is not None:
            seq.logprobs.append(token)
        reason = seq.token_stop(req.params, self.eos_token_ids)
        if reason is not None:
            self.finish_seq(seq.seq_id, reason)

    def apply_beams(self, req: Request, choices: list[tuple[int, int]]) -> None:
        """Next running beams as ``(parent seq id, token)``, best first."""
        parents = {s.seq_id: s for s in req.live_seqs}
        used: set[int] = set()
        targets = []
        for parent_id, token in choices:  # forks first, so children copy the parent before it grows
            target = parents[parent_id] if parent_id not in used else self._fork(req, parents[parent_id], 1)[0]
            used.add(parent_id)
            targets.append((target, token))
        for seq_id in parents.keys() - used:
            self._drop_seq(req, parents[seq_id])
        for target, token in targets:
            target.token_ids.append(token)
        req.seqs = [t for t, _ in targets]
        req.forked = True

    def finish_beams(self, req: Request, results: list[tuple[list[int], float]]) -> None:
        """End a beam-search request with its best hypotheses as the outputs."""
        for seq in list(req.live_seqs):
            self._drop_seq(req, seq)
        outputs = []
        for index, (tokens, score) in enumerate(results):
            seq = Sequence(-1 - index, req.prompt_ids + tokens, len(req.prompt_ids), index=index, cumulative_logprob=score)
            seq.finish_reason = FinishReason.STOP if tokens and tokens[-1] in self.eos_token_ids else FinishReason.LENGTH
            outputs.append(seq)
        req.seqs = outputs
        self._finish_request(req, FinishReason.STOP, None)

    def _drop_seq(self, req: Request, seq: Sequence) -> None:
        self.blocks.free(seq.seq_id)
        self._seqs.pop(seq.seq_id, None)
        self._owner.pop(seq.seq_id, None)
        req.seqs.remove(seq)
