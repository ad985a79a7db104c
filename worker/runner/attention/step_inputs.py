"""A forward's inputs from scheduled rows: token ids, positions, slots and the attention metadata
(block tables, lengths), ordered as the attention wants them (one-token rows first, prefill chunks
after). The target model's step and the draft model's rounds build theirs the same way."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pagedserve.worker.core.scheduling.plan import ScheduledSeq
from pagedserve.worker.runner.attention.paged_attention import AttentionMetadata


@dataclass(frozen=True)
class StepInputs:
    items: list[ScheduledSeq]  # the rows in batch order
    ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    meta: AttentionMetadata
    last_index: list[int]  # each row's last token in the batch


def step_inputs(rows, block_size: int, device: torch.device, needs_seq_lens: bool, num_lanes: int = 1) -> StepInputs:
    """``rows`` in any order -> the batch, single-token rows first; ``num_lanes``: the model's lanes
    of layers, each with its own slots and tables (``worker/core/kv_cache/kv_layout.py``)."""
    items = sorted(rows, key=lambda s: s.num_tokens > 1)
    ids, positions, slots, last_index = [], [], [], []
    for s in items:
        ids.extend(s.token_ids)
        positions.extend(range(s.start, s.context_len))
        slots.extend(s.slot_mapping(block_size))
        last_index.append(len(ids) - 1)
    num_decodes = sum(1 for s in items if s.num_tokens == 1)
    meta = _metadata(items, num_decodes, slots, device, needs_seq_lens)
    if num_lanes > 1:
        meta = replace(meta, other_lanes=tuple(_lane(meta, items, num_decodes, lane, block_size, device)
                                               for lane in range(1, num_lanes)))
    return StepInputs(items, torch.tensor(ids, dtype=torch.int64, device=device),
                      torch.tensor(positions, dtype=torch.int64, device=device), meta, last_index)


def _lane(meta: AttentionMetadata, items: list[ScheduledSeq], num_decodes: int, lane: int, block_size: int,
          dev: torch.device) -> AttentionMetadata:
    """``meta`` with ``lane``'s slots and tables."""
    slots = [slot for s in items for slot in s.slot_mapping(block_size, lane)]
    return replace(meta, slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
                   decode_block_tables=_tables(items[:num_decodes], dev, lane),
                   prefill_block_tables=_tables(items[num_decodes:], dev, lane))


def _metadata(items: list[ScheduledSeq], num_decodes: int, slots: list[int], dev: torch.device,
              needs_seq_lens: bool) -> AttentionMetadata:
    decodes, prefills = items[:num_decodes], items[num_decodes:]
    query_start = [0]
    for s in prefills:
        query_start.append(query_start[-1] + s.num_tokens)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        num_decodes=num_decodes,
        decode_block_tables=_tables(decodes, dev),
        decode_seq_lens=torch.tensor([s.context_len for s in decodes], dtype=torch.int32, device=dev),
        prefill_block_tables=_tables(prefills, dev),
        prefill_seq_lens=torch.tensor([s.context_len for s in prefills], dtype=torch.int32, device=dev),
        prefill_query_start=torch.tensor(query_start, dtype=torch.int32, device=dev),
        decode_max_seq_len=max((s.context_len for s in decodes), default=0),
        prefill_max_query_len=max((s.num_tokens for s in prefills), default=0),
        prefill_max_seq_len=max((s.context_len for s in prefills), default=0),
        token_seq_lens=torch.tensor([max(s.seq_len, s.context_len) for s in items for _ in s.token_ids],
                                    dtype=torch.int32, device=dev) if needs_seq_lens else None,
    )


def _tables(items: list[ScheduledSeq], dev: torch.device, lane: int = 0) -> torch.Tensor:
    tables = [s.table(lane) for s in items]
    width = max((len(t) for t in tables), default=0)
    rows = [list(t) + [0] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=torch.int32, device=dev).view(len(items), width)
