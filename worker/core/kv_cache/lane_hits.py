"""A prefix hit when a sequence has several lanes of layers (``kv_layout.py``): the longest run of
cached blocks that every lane can start from, each by its own rule (vLLM's hybrid manager's).

A full lane needs every block of the prefix. A sliding lane of window W needs only the blocks the
first computed position can still see: for a hit of ``n`` blocks the next position is
``p = n * block_size``, which sees ``p - W + 1 .. p - 1``; the lane's earlier entries stay
released (``NO_BLOCK``). So a long conversation whose old sliding blocks were evicted still hits
in full, and the hit is the longest ``n`` every lane accepts.

Pure Python, no torch.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from pagedserve.worker.core.kv_cache.block_pool import BlockPool
from pagedserve.worker.core.kv_cache.block_tables import NO_BLOCK


LANE_MIX = 0x9E3779B97F4A7C15  # odd: each lane's multiple differs in its low 63 bits


def lane_hash(base: int, lane: int) -> int:
    """The hash a lane's copy of a block is cached under: the prefix's own for the first lane, a
    cheap mix for the others (never announced; a collision is caught by the key, as any)."""
    return base if lane == 0 else (base ^ (lane * LANE_MIX)) & ((1 << 63) - 1)


def lane_key(key: tuple, lane: int) -> tuple:
    return key if lane == 0 else key + (("lane", lane),)


def first_seen(num_blocks: int, window: int, block_size: int) -> int:
    """The first block a query at position ``num_blocks * block_size`` reads (0 without a window)."""
    return max(0, num_blocks * block_size - window + 1) // block_size if window else 0


def lane_hit(pool: BlockPool, chain: Iterable[tuple[int, tuple]], windows: Sequence[int],
             block_size: int) -> tuple[list[list[int]], list[int]]:
    """Each lane's table of the longest hit over ``chain`` (``(hash, key)`` of the prompt's leading
    full blocks, read up to a full lane's first miss): the cached blocks, ``NO_BLOCK`` where a
    sliding lane needs none; and the hit's hashes."""
    found: list[list[int | None]] = [[] for _ in windows]
    hashes: list[int] = []
    for base, key in chain:
        blocks = [pool.lookup(lane_hash(base, lane), lane_key(key, lane)) for lane in range(len(windows))]
        if any(b is None for b, w in zip(blocks, windows) if not w):  # a full lane stops here
            break
        for lane, block in enumerate(blocks):
            found[lane].append(block)
        hashes.append(base)
    for n in range(len(hashes), 0, -1):
        firsts = [first_seen(n, w, block_size) for w in windows]
        if all(None not in found[lane][first:n] for lane, first in enumerate(firsts)):
            return [[NO_BLOCK] * first + found[lane][first:n] for lane, first in enumerate(firsts)], hashes[:n]
    return [[] for _ in windows], []
