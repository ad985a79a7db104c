"""Speculative decoding's draft model: a small model of the same vocabulary drafts a row's next
tokens greedily, one forward per drafted token, batched over the step's drafting rows.

Its KV lives in a pool of its own laid out on the **target's block ids**: a row's block table
holds the draft's KV at the same slots as the target's, so the draft needs no block manager, and a
draft's slots (given by the scheduler from free blocks) hold both models' KV for the drafted
positions. The scheduler tracks how far each sequence's draft KV is valid (``Sequence.draft_computed``;
0 after a preemption, whose blocks go or move without the draft's KV) and sends the tokens before
the row's own that the draft has not taken in (``ScheduledSeq.draft_context``); the first round
takes them in with the row's token (a prefill, in pieces of ``CATCH_UP_CHUNK``), each later round
one draft. A wrong draft KV (a prefix block another row's draft wrote, a block reused) can only
make drafts worse, never tokens wrong: the target checks every draft (``draft_check.py``). On CUDA
its rounds replay decode graphs of their own (``graphs``, set by the runner: the draft model's
weights and KV, the target's limits), as the target's steps do: a round is a decode step of a small
model, where launching is most of the time.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pagedserve.kernels.kv_format import KVFormat
from pagedserve.kernels.ops import AttentionOps
from pagedserve.worker.core.scheduling.plan import ScheduledSeq
from pagedserve.worker.runner.attention.kept_tables import KeptTables
from pagedserve.worker.runner.attention.step_inputs import step_inputs
from pagedserve.worker.runner.device.cuda_graphs import DecodeGraphs
from pagedserve.worker.runner.kv_cache.pool import layer_caches, pool_shape, zeroed_pool
from pagedserve.worker.runner.models.layers import CausalLM

CATCH_UP_CHUNK = 1024  # tokens of a row's draft context taken in per forward


class Drafter:
    def __init__(self, model: CausalLM, ops: AttentionOps, device: torch.device, dtype: torch.dtype, kv: KVFormat,
                 block_size: int, num_blocks: int) -> None:
        self.model, self.ops, self.device, self.block_size = model, ops, device, block_size
        self.kv_pool = zeroed_pool(pool_shape(model, num_blocks, block_size, kv), kv.storage_dtype(dtype), device)
        self.kv_caches = layer_caches(self.kv_pool, model)
        self._tables: KeptTables | None = None  # the runner's, during a draft()
        self.graphs: DecodeGraphs | None = None  # the rounds' CUDA graphs (ModelRunner sets them on CUDA)

    @torch.inference_mode()
    def draft(self, seqs: tuple[ScheduledSeq, ...], tables: KeptTables) -> tuple[tuple[ScheduledSeq, ...], int]:
        """The step's rows with every draft-model draft made (the rows with ``draft_context``), and
        how many rounds (forwards over the drafting rows, catch-up pieces aside) that took.
        ``tables``: the runner's, updated with ``seqs`` (the draft model reads the first lane's)."""
        self._tables = tables
        rows = {s.seq_id: s for s in seqs if s.draft_context is not None}
        drafts: dict[int, list[int]] = {seq_id: [] for seq_id in rows}
        current = self._catch_up([replace(s, token_ids=s.draft_context + s.token_ids[: -s.num_draft],
                                          start=s.start - len(s.draft_context)) for s in rows.values()])
        rounds = 0
        while current:
            rounds += 1
            for seq_id, token in self._greedy(current).items():
                drafts[seq_id].append(token)
            current = [replace(s, token_ids=(drafts[s.seq_id][-1],), start=s.start + len(drafts[s.seq_id]))
                       for s in rows.values() if len(drafts[s.seq_id]) < s.num_draft]
        return tuple(replace(s, token_ids=s.token_ids[: -s.num_draft] + tuple(drafts[s.seq_id])) if s.seq_id in rows else s
                     for s in seqs), rounds

    def _catch_up(self, rows: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Take in the rows' context but its last piece, ``CATCH_UP_CHUNK`` tokens a row per forward."""
        while long := [r for r in rows if r.num_tokens > CATCH_UP_CHUNK]:
            self._forward([replace(r, token_ids=r.token_ids[:CATCH_UP_CHUNK]) for r in long])
            rows = [replace(r, token_ids=r.token_ids[CATCH_UP_CHUNK:], start=r.start + CATCH_UP_CHUNK)
                    if r.num_tokens > CATCH_UP_CHUNK else r for r in rows]
        return rows

    def _forward(self, rows: list[ScheduledSeq]):
        batch = step_inputs(rows, self.block_size, self.device, self.model.rotary.needs_seq_lens, tables=self._tables)
        return batch, self.model(batch.ids, batch.positions, batch.meta, self.kv_caches)

    def _greedy(self, rows: list[ScheduledSeq]) -> dict[int, int]:
        """Each row's next token by the draft model: its argmax after the row's last token."""
        if self.graphs is not None and self.graphs.can_run(rows):
            logits, last_index = self.graphs.run(rows, self._tables)
            last = torch.tensor(last_index, dtype=torch.int64, device=self.device)
            return {s.seq_id: token for s, token in zip(rows, logits[last].argmax(dim=-1).tolist())}
        batch, hidden = self._forward(rows)
        last = torch.tensor(batch.last_index, dtype=torch.int64, device=self.device)
        picks = self.model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
        return {s.seq_id: token for s, token in zip(batch.items, picks)}
