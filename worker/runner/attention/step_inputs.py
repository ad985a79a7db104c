"""A forward's inputs from scheduled rows: token ids, positions, slots and the attention metadata
(block tables, lengths), ordered as the attention wants them (one-token rows first, prefill chunks
after). The target model's step and the draft model's rounds build theirs the same way."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pagedserve.worker.core.scheduling.plan import ScheduledSeq
from pagedserve.worker.runner.attention.kept_tables import KeptTables
from pagedserve.worker.runner.attention.paged_attention import AttentionMetadata
from pagedserve.worker.runner.transfers.host_copies import device_tensor


@dataclass(frozen=True)
class StepInputs:
    items: list[ScheduledSeq]  # the rows in batch order
    ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    meta: AttentionMetadata
    last_index: list[int]  # each row's last token in the batch


def step_inputs(rows, block_size: int, device: torch.device, needs_seq_lens: bool, num_lanes: int = 1,
                tables: KeptTables | None = None) -> StepInputs:
    """``rows`` in any order -> the batch, single-token rows first; ``num_lanes``: the model's lanes
    of layers, each with its own slots and tables (``worker/core/kv_cache/kv_layout.py``).
    ``tables``: the runner's kept tables, already updated with ``rows``; None: the rows carry their
    whole tables."""
    items = sorted(rows, key=lambda s: s.num_tokens > 1)
    tables = tables if tables is not None else KeptTables.of(items, num_lanes)
    ids, positions, token_seqs, last_index = [], [], [], []
    for s in items:
        ids.extend(s.token_ids)
        positions.extend(range(s.start, s.context_len))
        token_seqs.extend([s.seq_id] * s.num_tokens)
        last_index.append(len(ids) - 1)
    num_decodes = sum(1 for s in items if s.num_tokens == 1)
    slots = tables.slots(token_seqs, positions, block_size, device)
    seq_ids = [s.seq_id for s in items]
    decode_tables, prefill_tables = tables.tables(seq_ids[:num_decodes], device), tables.tables(seq_ids[num_decodes:], device)
    lanes = [dict(slot_mapping=slots[lane], decode_block_tables=decode_tables[lane], prefill_block_tables=prefill_tables[lane])
             for lane in range(num_lanes)]
    meta = _metadata(items, num_decodes, device, needs_seq_lens, lanes[0])
    meta = replace(meta, other_lanes=tuple(replace(meta, **lane) for lane in lanes[1:]))
    return StepInputs(items, device_tensor(ids, torch.int64, device),
                      device_tensor(positions, torch.int64, device), meta, last_index)


def _metadata(items: list[ScheduledSeq], num_decodes: int, dev: torch.device, needs_seq_lens: bool,
              first_lane: dict) -> AttentionMetadata:
    decodes, prefills = items[:num_decodes], items[num_decodes:]
    query_start = [0]
    for s in prefills:
        query_start.append(query_start[-1] + s.num_tokens)
    return AttentionMetadata(
        num_decodes=num_decodes,
        decode_seq_lens=device_tensor([s.context_len for s in decodes], torch.int32, dev),
        prefill_seq_lens=device_tensor([s.context_len for s in prefills], torch.int32, dev),
        prefill_query_start=device_tensor(query_start, torch.int32, dev),
        decode_max_seq_len=max((s.context_len for s in decodes), default=0),
        prefill_max_query_len=max((s.num_tokens for s in prefills), default=0),
        prefill_max_seq_len=max((s.context_len for s in prefills), default=0),
        token_seq_lens=device_tensor([max(s.seq_len, s.context_len) for s in items for _ in s.token_ids],
                                     torch.int32, dev) if needs_seq_lens else None,
        **first_lane,
    )
