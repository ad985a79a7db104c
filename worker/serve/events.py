"""Engine outputs -> wire events: one event per request per step, numbered per request. Logprob
entries carry each token's text (``core/scheduling/token_pieces.py``), so no reader needs a tokenizer to show them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from pagedserve.shared.protocol import OutputDelta, ReplyTarget, WireEvent, WireRequest, can_resume
from pagedserve.worker.core.scheduling.outputs import CompletionOutput, RequestOutput


@dataclass
class InFlight:
    """A stream entry this worker holds, and what it has sent about it."""

    entry_id: str
    request: WireRequest
    next_seq: int = 0
    reported_finish: set[int] = field(default_factory=set)
    orphaned: bool = False  # its entry is gone or another worker holds it: compute on, send nothing
    started: bool = False  # an event went out (the reader counts the requests not started yet)
    accepted_at: float = field(default_factory=time.time)  # wall clock, as the request's ``created``
    queue_reported: bool = False
    deliveries: int = 1  # the entry's delivery count when this worker took it: on every event it sends

    def __post_init__(self) -> None:
        if self.request.resume is not None:
            self.next_seq = self.request.resume.seq

    @property
    def target(self) -> ReplyTarget:
        return self.request.reply

    def take_seq(self) -> int:
        self.next_seq += 1
        return self.next_seq - 1


def request_finish_reason(out: RequestOutput) -> str | None:
    reasons = [o.finish_reason for o in out.outputs]
    for worst in ("error", "abort"):
        if worst in reasons:
            return worst
    return reasons[0] if reasons else None


def event_for(flight: InFlight, out: RequestOutput, piece: Callable[[int], str]) -> WireEvent | None:
    """The event this step's output calls for, or None when nothing changed; ``piece``: a token
    id's text, for logprobs."""
    deltas = []
    for o in out.outputs:
        newly_finished = o.finish_reason is not None and o.index not in flight.reported_finish
        if not (o.new_token_ids or o.text_delta or newly_finished):
            continue
        if newly_finished:
            flight.reported_finish.add(o.index)
        deltas.append(OutputDelta(o.index, list(o.new_token_ids), o.text_delta,
                                  o.finish_reason if newly_finished else None, _logprobs(o, piece),
                                  o.stop_reason if newly_finished else None))
    if not deltas and not out.finished:
        return None
    usage = None
    if out.finished:
        usage = {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": sum(len(o.token_ids) for o in out.outputs),
                 "cached_tokens": out.num_cached_tokens or 0}
    queue_s = None
    if not flight.queue_reported and out.queued_s is not None:  # once: the stream's wait plus the engine's
        flight.queue_reported = True
        queue_s = round(max(0.0, flight.accepted_at - flight.request.created) + out.queued_s, 6)
    prompt = None
    if out.finished and out.prompt_logprobs is not None:
        prompt = [None] + [_entry(t, piece) for t in out.prompt_logprobs[1:]]
    return WireEvent(out.request_id, flight.take_seq(), deltas, out.finished,
                     request_finish_reason(out) if out.finished else None, out.error, usage, queue_s=queue_s,
                     prompt_logprobs=prompt, embedding=out.embedding, delivery=flight.deliveries)


def error_event(request_id: str, seq: int, message: str, resumable: bool = False, delivery: int = 0) -> WireEvent:
    """A terminal error; ``delivery``: the sender's entry's delivery count (0: none held)."""
    return WireEvent(request_id, seq, [], True, "error", message, {"prompt_tokens": 0, "completion_tokens": 0}, resumable,
                     delivery=delivery)


def lost_event(req: WireRequest, delivery: int) -> WireEvent:
    """What a worker taking over a request that had already streamed sends (``delivery``: its
    entry's count, above the dead holder's): a terminal error that tells the client whether it can
    re-send the request with ``resume``."""
    return error_event(req.id, -1, "the worker serving this request died mid-stream", can_resume(req.params), delivery)


def _logprobs(o: CompletionOutput, piece: Callable[[int], str]) -> list[dict] | None:
    if o.logprobs is None or not o.new_token_ids:
        return None
    return [_entry(t, piece) for t in o.logprobs[-len(o.new_token_ids):]]


def _entry(t, piece: Callable[[int], str]) -> dict:
    """A token's logprob entry on the wire, with its text and its alternatives' texts."""
    top = t.top_logprobs or {}
    return {"token_id": t.token_id, "token": piece(t.token_id), "logprob": t.logprob, "top": top,
            "top_tokens": {i: piece(i) for i in top}}
