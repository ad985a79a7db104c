"""The scheduler's state: every live request, its sequences, and the three queues it can be in.

``RequestTable`` owns the bookkeeping that every part of a step shares: new sequences and forks
(which share their parent's blocks), dropping a beam, finishing a sequence or a whole request (its
blocks freed, it leaves its queue). Requests that end outside ``update`` (aborts, deadlines) are
remembered until the next ``update`` reports them; every ended request id is remembered until the
next plan tells the runner to drop what it keeps for it. No policy lives here.
"""

from __future__ import annotations

import itertools

from pagedserve.worker.core.kv_cache.block_manager import BlockManager
from pagedserve.worker.core.scheduling.request import FinishReason, Request, RequestStatus, Sequence


class RequestTable:
    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.ended_outside_update: list[Request] = []
        self.ended_ids: list[str] = []
        self.dropped_seq_ids: list[int] = []  # beams that fell out since the last plan (their requests go on)
        self._seqs: dict[int, Sequence] = {}
        self._owner: dict[int, Request] = {}
        self._seq_ids = itertools.count()

    def seq(self, seq_id: int) -> Sequence | None:
        return self._seqs.get(seq_id)

    def owner(self, seq_id: int) -> Request:
        return self._owner[seq_id]

    def new_seq(self, req: Request, token_ids: list[int], index: int) -> Sequence:
        seq = Sequence(next(self._seq_ids), token_ids, len(req.prompt_ids), index=index)
        req.seqs.append(seq)
        self._seqs[seq.seq_id] = seq
        self._owner[seq.seq_id] = req
        return seq

    def fork(self, req: Request, parent: Sequence, count: int) -> list[Sequence]:
        """``count`` children sharing every block of ``parent`` (copy-on-write)."""
        req.forked = True
        children = []
        for i in range(count):
            child = self.new_seq(req, list(parent.token_ids), index=i + 1)
            child.num_computed = parent.num_computed
            if parent.grammar is not None:  # each child advances its own
                child.grammar = parent.grammar.deep_copy()
            self.blocks.fork(parent.seq_id, child.seq_id)
            children.append(child)
        return children

    def drop_seq(self, req: Request, seq: Sequence) -> None:
        """Remove a sequence nobody continues (a beam that fell out), freeing its blocks."""
        self.blocks.free(seq.seq_id)
        self._seqs.pop(seq.seq_id, None)
        self._owner.pop(seq.seq_id, None)
        req.seqs.remove(seq)
        self.dropped_seq_ids.append(seq.seq_id)

    def finish_seq(self, seq_id: int, reason: FinishReason) -> None:
        """End one sequence (a stop token or string, its length); the request ends with its last."""
        seq = self._seqs[seq_id]
        if seq.finished:
            return
        seq.finish_reason = reason
        self.blocks.free(seq_id)
        req = self._owner[seq_id]
        if not req.live_seqs:
            self.finish_request(req, reason, None)

    def finish_request(self, req: Request, reason: FinishReason, error: str | None) -> None:
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
        self.ended_ids.append(req.request_id)

    def end_outside_update(self, req: Request, reason: FinishReason, error: str | None) -> None:
        """Abort or deadline: finish now, report at the next ``update``."""
        self.finish_request(req, reason, error)
        self.ended_outside_update.append(req)

    def take_ended_ids(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """The requests that ended and the sequences dropped since the last call (the runner forgets
        what it keeps of them)."""
        ended, self.ended_ids = tuple(self.ended_ids), []
        dropped, self.dropped_seq_ids = tuple(self.dropped_seq_ids), []
        return ended, dropped
