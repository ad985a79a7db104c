"""Block tables (a sequence's block ids, in order, one table per lane of layers:
``worker/core/kv_cache/kv_layout.py``) and their moves between two pools: what a swap does
(``BlockManager.swap_out`` / ``swap_in``), with nothing else of the block manager's state."""

from __future__ import annotations

from typing import Sequence

from pagedserve.worker.core.kv_cache.block_pool import BlockPool

NO_BLOCK = -1  # a table entry whose block was released: wholly outside its lane's sliding window
BELOW = -2  # a prefix hit's entry that a block from a tier under the device fills (``BlockManager.promote``)

Lanes = list[list[int]]  # a sequence's tables, one per lane


def held_blocks(lanes: Lanes) -> list[int]:
    """Every block a sequence's tables hold, lane after lane (an entry that names none is negative)."""
    return [b for table in lanes for b in table if b >= 0]


def count_unique(tables: dict[int, Lanes], seq_ids: Sequence[int]) -> int:
    """Blocks these sequences' tables hold, a shared one counted once."""
    return len({b for s in seq_ids for b in held_blocks(tables[s])})


def move_tables(seq_ids: Sequence[int], src_tables: dict[int, Lanes], dst_tables: dict[int, Lanes],
                src_pool: BlockPool, dst_pool: BlockPool) -> list[tuple[int, int]]:
    """Move the sequences' tables from ``src_pool`` to ``dst_pool``: a block shared inside the group
    gets one copy, released entries stay released. The ``(src, dst)`` block copies to make."""
    if count_unique(src_tables, seq_ids) > dst_pool.num_free:
        raise ValueError(f"not enough free {dst_pool.name} blocks to move {list(seq_ids)}")
    mapping: dict[int, int] = {}
    old_tables = [src_tables.pop(seq_id) for seq_id in seq_ids]
    for seq_id, old in zip(seq_ids, old_tables):
        for block in held_blocks(old):
            if block in mapping:
                dst_pool.incref(mapping[block])
            else:
                mapping[block] = dst_pool.allocate()
        dst_tables[seq_id] = [[mapping.get(block, NO_BLOCK) for block in table] for table in old]
    for old in old_tables:
        for block in held_blocks(old):
            src_pool.decref(block)
    return list(mapping.items())
