"""A prefix hit when a sequence has several lanes of layers (``kv_layout.py``): the longest run of
cached blocks that every lane can start from, each by its own rule (vLLM's hybrid manager's).

A full lane needs every block of the prefix. A sliding lane of window W needs only the blocks the
first computed position can still see: for a hit of ``n`` blocks the next position is
``p = n * block_size``, which sees ``p - W + 1 .. p - 1``; the lane's earlier entries stay
released (``NO_BLOCK``). So a long conversation whose old sliding blocks were evicted still hits
in full, and the hit is the longest ``n`` every lane accepts. One lane is the same rule: a full
lane takes its whole cached prefix.

A lane's copy of a block may be on the device or in a tier below it (``tiers.py``): the finder
says where, and the caller fetches only the entries the hit needs.

Pure Python, no torch.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from pagedserve.worker.core.kv_cache.block_tables import NO_BLOCK

LANE_MIX = 0x9E3779B97F4A7C15  # odd: each lane's multiple differs in its low 63 bits
LANE_BIT = 1 << 63  # set in every further lane's hash, never in a prefix's own (63 bits, shared/block_hash.py)


def lane_hash(base: int, lane: int) -> int:
    """The hash a lane's copy of a block is cached under, on the device and in the tiers: the
    prefix's own for the first lane, a cheap mix with ``LANE_BIT`` set for the others (never
    announced to KV events; a collision is caught by the key, as any)."""
    return base if lane == 0 else LANE_BIT | ((base ^ (lane * LANE_MIX)) & (LANE_BIT - 1))


def is_lane_hash(block_hash: int) -> bool:
    """Whether ``block_hash`` names a further lane's copy (not a prefix routing knows)."""
    return block_hash >= LANE_BIT


def lane_key(key: tuple, lane: int) -> tuple:
    """A lane's copy's key: the lane joins the salt, so the key keeps its three parts (the disk
    tier writes them)."""
    parent, tokens, salt = key
    return key if lane == 0 else (parent, tokens, ("lane", lane, salt))


def first_seen(num_blocks: int, window: int, block_size: int) -> int:
    """The first block a query at position ``num_blocks * block_size`` reads (0 without a window)."""
    return max(0, num_blocks * block_size - window + 1) // block_size if window else 0


def lane_hit(find: Callable[[int, tuple], object | None], chain: Iterable[tuple[int, tuple]],
             windows: Sequence[int], block_size: int) -> tuple[list[list], list[int]]:
    """Each lane's table of the longest hit over ``chain`` (``(hash, key)`` of the prompt's leading
    full blocks, read up to a full lane's first miss) and the hit's hashes. ``find(hash, key)``
    says where a lane's copy is (a device block, or whatever the caller fetches it by), None when
    nowhere; a table holds what it said, ``NO_BLOCK`` where a sliding lane needs nothing."""
    found: list[list] = [[] for _ in windows]
    hashes: list[int] = []
    for base, key in chain:
        entries = [find(lane_hash(base, lane), lane_key(key, lane)) for lane in range(len(windows))]
        if any(e is None for e, w in zip(entries, windows) if not w):  # a full lane stops here
            break
        for lane, entry in enumerate(entries):
            found[lane].append(entry)
        hashes.append(base)
    for n in range(len(hashes), 0, -1):
        firsts = [first_seen(n, w, block_size) for w in windows]
        if all(None not in found[lane][first:n] for lane, first in enumerate(firsts)):
            return [[NO_BLOCK] * first + found[lane][first:n] for lane, first in enumerate(firsts)], hashes[:n]
    return [[] for _ in windows], []
