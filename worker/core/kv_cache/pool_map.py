"""The block pool as a picture for the KV dashboard: one cell per block, or per group of blocks
when there are many, run-length encoded, within a byte budget at any pool size.

A cell's value: ``0`` free, ``1`` cached but free (in the prefix cache, evictable), ``1 + r`` held
by ``r`` block tables (``2``: one sequence, ``3`` and up: shared copy-on-write; capped at
``MAX_VALUE``). A group's cell shows the most shared of its blocks, so sharing never disappears
when the picture is coarse. ``encode`` returns ``[cells, group, v0, n0, v1, n1, …]``: values and
run lengths in pool order, at most ``2 * MAX_CELLS`` numbers, which msgpack writes in at most
``BYTE_BUDGET`` bytes (each number below 2^16: 3 bytes, and most runs far shorter).
Taken on the engine thread (the only one touching the pool), as part of the dashboard's snapshot
(``worker/core/scheduling/kv_snapshot.py``; costs in docs/dashboard.md).
"""

from __future__ import annotations

from pagedserve.worker.core.kv_cache.block_pool import BlockPool

MAX_CELLS = 8192
MAX_VALUE = 255
BYTE_BUDGET = 2 * MAX_CELLS * 3 + 16
VALUE_OF_REFCOUNT = bytes([0] + [min(MAX_VALUE, 1 + r) for r in range(1, 256)])  # bytes.translate table


def cell_values(pool: BlockPool) -> bytearray:
    """Each block's value, in block order (a byte each: C-speed conversions, not a Python loop over
    a million blocks)."""
    refs = pool.ref_counts()
    if max(refs, default=0) > MAX_VALUE:
        refs = [min(r, MAX_VALUE) for r in refs]
    values = bytearray(refs).translate(VALUE_OF_REFCOUNT)
    for block in pool.cached_blocks():
        values[block] = 1
    return values


def encode(values: bytes | list[int], max_cells: int = MAX_CELLS) -> list[int]:
    group = max(1, -(-len(values) // max_cells))
    cells = [max(values[i : i + group]) for i in range(0, len(values), group)] if group > 1 else values
    out = [len(cells), group]
    for value in cells:
        if len(out) > 2 and out[-2] == value:
            out[-1] += 1
        else:
            out += [value, 1]
    return out


def decode(encoded: list[int]) -> tuple[list[int], int]:
    """``(cells, group)`` from ``encode``'s list."""
    cells: list[int] = []
    for i in range(2, len(encoded), 2):
        cells += [encoded[i]] * encoded[i + 1]
    if len(cells) != encoded[0]:
        raise ValueError(f"runs cover {len(cells)} cells, the header says {encoded[0]}")
    return cells, encoded[1]
