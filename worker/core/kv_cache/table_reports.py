"""The block manager's per-sequence state (``TableState``), what it reports of it (``usage_of``:
``BlockUsage``) and the checks tests run on it every step (``check_tables``): read only, no decision.

Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from pagedserve.worker.core.kv_cache.block_pool import BlockPool
from pagedserve.worker.core.kv_cache.block_tables import NO_BLOCK, Lanes


@dataclass
class TableState:
    tables: dict[int, Lanes] = field(default_factory=dict)  # seq -> its table in each lane, on the device
    cpu_tables: dict[int, Lanes] = field(default_factory=dict)  # swapped out
    num_slots: dict[int, int] = field(default_factory=dict)
    hashes: dict[int, list[int]] = field(default_factory=dict)  # chained hashes of the seq's leading full blocks
    released: dict[int, list[int]] = field(default_factory=dict)  # each lane's leading entries released (sliding window)
    kept: dict[int, int] = field(default_factory=dict)  # the seq's leading entries (every lane's) the runner holds as they are


@dataclass(frozen=True)
class BlockUsage:
    """A snapshot of the pools for logs, metrics and benchmarks."""

    total: int
    used: int
    free: int
    cached: int
    cpu_total: int
    cpu_used: int
    logical: int  # block-table entries on the GPU; logical - used = blocks saved by sharing
    tokens_held: int
    slot_utilization: float  # tokens held / (used blocks * block_size); 1.0 when nothing is used


def usage_of(state: TableState, gpu: BlockPool, cpu: BlockPool, block_size: int) -> BlockUsage:
    """Counts of both pools. Read on the engine thread a few times a second (metrics, the
    dashboard): every block but a table's last is full, so the tokens held need one set of
    block ids, not a loop over every entry (a million-block pool: ~30 ms, was ~600 ms)."""
    full: set[int] = set()
    last: dict[int, int] = {}  # a table's last block -> the most slots any holder fills in it
    logical = 0
    for seq_id, lanes in state.tables.items():
        for table, released in zip(lanes, state.released[seq_id]):
            live = table[released:]
            if not live:
                continue
            logical += len(live)
            full.update(live[:-1])
            fill = state.num_slots[seq_id] - (len(table) - 1) * block_size
            last[live[-1]] = max(last.get(live[-1], 0), fill)
    tokens = block_size * len(full) + sum(fill for block, fill in last.items() if block not in full)
    used = gpu.num_used
    return BlockUsage(
        total=gpu.num_blocks,
        used=used,
        free=gpu.num_free,
        cached=gpu.num_cached,
        cpu_total=cpu.num_blocks,
        cpu_used=cpu.num_used,
        logical=logical,
        tokens_held=tokens,
        slot_utilization=tokens / (used * block_size) if used else 1.0,
    )


def check_tables(state: TableState, lane_windows: Sequence[int], block_size: int) -> None:
    """Raise AssertionError where the tables disagree with the slots, the lanes, the released
    entries, the hashes or what the runner is said to hold."""
    both = state.tables.keys() & state.cpu_tables.keys()
    if both:
        raise AssertionError(f"sequences on both devices: {sorted(both)}")
    for seq_id, slots in state.num_slots.items():
        blocks = -(-slots // block_size)
        lanes = state.tables.get(seq_id, state.cpu_tables.get(seq_id))
        if lanes is None or len(lanes) != len(lane_windows):
            raise AssertionError(f"seq {seq_id}: {lanes} is not one table per lane ({len(lane_windows)})")
        for lane, (table, released, window) in enumerate(zip(lanes, state.released[seq_id], lane_windows)):
            if len(table) != blocks:
                raise AssertionError(f"seq {seq_id}: {slots} slots but lane {lane}'s table {table}")
            if any(b == NO_BLOCK for b in table[released:]) or any(b != NO_BLOCK for b in table[:released]):
                raise AssertionError(f"seq {seq_id}: lane {lane}'s released entries are not the leading "
                                     f"{released}: {table}")
            if released and not window:
                raise AssertionError(f"seq {seq_id}: full lane {lane} released blocks")
        if state.kept.get(seq_id, 0) > len(lanes[0]):
            raise AssertionError(f"seq {seq_id}: the runner is said to hold {state.kept[seq_id]} entries of its "
                                 f"{len(lanes[0])}-entry tables")
        if len(state.hashes[seq_id]) > blocks:
            raise AssertionError(f"seq {seq_id}: more hashes than blocks")
