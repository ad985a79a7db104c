"""Requests -> ``RequestOutput`` (the second half of ``Scheduler.update``).

Each sequence's new tokens go through its incremental detokenizer; a stop string found there ends
the sequence (through the request table, so its blocks are freed at once). Beam search and
``best_of`` report only their final answers; ``best_of`` keeps the ``n`` outputs with the highest
cumulative logprob. Without a detokenizer (scheduler tests) outputs carry token ids and no text.
"""

from __future__ import annotations

from dataclasses import replace

from pagedserve.worker.core.scheduling.detokenizer import Detokenizer, DetokenizerState
from pagedserve.worker.core.scheduling.outputs import CompletionOutput, RequestOutput
from pagedserve.worker.core.scheduling.request import FinishReason, Request, Sequence
from pagedserve.worker.core.scheduling.request_table import RequestTable


class OutputBuilder:
    def __init__(self, table: RequestTable, detokenizer: Detokenizer | None) -> None:
        self.table = table
        self.detokenizer = detokenizer
        self._states: dict[int, DetokenizerState] = {}

    def build(self, requests: list[Request]) -> list[RequestOutput]:
        return [out for req in requests if (out := self._output(req)) is not None]

    def _output(self, req: Request) -> RequestOutput | None:
        hold = req.params.use_beam_search or req.params.best_of is not None
        if hold and not req.finished:
            return None
        outputs = [self._completion(req, seq) for seq in req.seqs]
        if req.finished:
            for seq in req.seqs:
                self._states.pop(seq.seq_id, None)
            if req.params.best_of is not None:
                best = sorted(outputs, key=lambda o: -o.cumulative_logprob)[: req.params.n]
                outputs = [replace(o, index=i) for i, o in enumerate(best)]
        queued = None if req.first_scheduled is None else max(0.0, req.first_scheduled - req.arrival)
        prompt = [None, *req.prompt_logprobs] if req.finished and req.params.prompt_logprobs is not None else None
        embedding = req.embedding if req.finished else None
        return RequestOutput(req.request_id, req.prompt_ids, outputs, req.finished, req.error, queued, prompt, embedding,
                             req.cached_tokens, req.tier_cached_tokens)

    def _completion(self, req: Request, seq: Sequence) -> CompletionOutput:
        seen, text, delta = self._detokenize(req, seq)
        return CompletionOutput(
            index=seq.index, text=text, token_ids=seq.output_ids,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=list(seq.logprobs) if req.params.logprobs is not None else None,
            text_delta=delta, new_token_ids=tuple(seq.token_ids[seen:]), stop_reason=seq.stop_reason,
        )

    def _detokenize(self, req: Request, seq: Sequence) -> tuple[int, str, str]:
        """(tokens seen before, all text, new text); ends the sequence on a stop string."""
        detok, skip = self.detokenizer, req.params.skip_special_tokens
        state = self._states.get(seq.seq_id)
        if state is None:
            state = self._states[seq.seq_id] = Detokenizer.new_state(seq.prompt_len)
            if req.resumed:  # the client has these tokens and their text: go on from there
                sent = seq.token_ids[: seq.prompt_len + req.resumed]
                if detok is not None:
                    detok.update(state, sent, req.params.stop, skip, final=False)
                state.tokens_seen = len(sent)
        seen = state.tokens_seen
        if detok is None:  # token ids only (scheduler tests)
            state.tokens_seen = seq.num_tokens
            return seen, "", ""
        delta = detok.update(state, seq.token_ids, req.params.stop, skip, final=seq.finished)
        if state.stopped and not seq.finished:
            seq.stop_reason = state.stop_string
            self.table.finish_seq(seq.seq_id, FinishReason.STOP)
            delta += detok.update(state, seq.token_ids, (), skip, final=True)
        return seen, state.text, delta
