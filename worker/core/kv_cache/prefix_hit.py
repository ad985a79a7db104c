"""A prefix hit: the cached full blocks at the start of a prompt that every lane of the model can
start from (``lane_hits.py``: a full lane needs each block, a sliding lane only its window's), each
lane's copy on the device or in a tier under it (``tiers.py``). Only the entries the hit needs are
fetched from below: a host slot promoted, a disk file read, every read a hit needs asked for at once
(while one is read, the hit waits). ``BlockManager.start`` takes the device blocks and
``BlockManager.promote`` fills the ``BELOW`` entries.

Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable, NamedTuple, Sequence

from pagedserve.worker.core.kv_cache.block_pool import BlockPool
from pagedserve.worker.core.kv_cache.block_tables import BELOW, held_blocks
from pagedserve.worker.core.kv_cache.lane_hits import lane_hit
from pagedserve.worker.core.kv_cache.tiers import PENDING, KvTiers, LowerHit


class Below(NamedTuple):
    """Where a lane's copy of a prefix block is when it is in a tier under the device."""
    block_hash: int
    key: tuple


@dataclass(frozen=True)
class PrefixHit:
    """Each lane's table of the hit (device blocks; ``NO_BLOCK`` where a sliding lane needs none;
    ``BELOW`` where a block from a tier under the device fills it: ``lower``, in table order, lane
    after lane, each needing a free device block), and the prefix's chained hashes."""

    tables: tuple[tuple[int, ...], ...] = ()
    hashes: tuple[int, ...] = ()
    num_reclaimed: int = 0  # how many of its device blocks are cached-free now, so taking them uses free capacity
    lower: tuple[LowerHit, ...] = ()
    waits_on_disk: bool = False  # the prefix goes on in a block being read from disk: start later

    @property
    def blocks(self) -> tuple[int, ...]:
        """The first lane's table of the hit."""
        return self.tables[0] if self.tables else ()

    def held(self) -> list[int]:
        """The device blocks the hit takes, every lane's."""
        return held_blocks(self.tables)

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    @property
    def num_lower_blocks(self) -> int:
        """Of its blocks, how many some lane reads from below the device."""
        return sum(1 for column in zip(*self.tables) if BELOW in column)


NO_HIT = PrefixHit()


def find_hit(gpu: BlockPool, tiers: KvTiers | None, windows: Sequence[int], block_size: int,
             chain: Callable[[], Iterable[tuple[int, tuple]]]) -> PrefixHit:
    """The hit over ``chain()`` (``(hash, key)`` of the prompt's full blocks a hit can cover)."""
    missing: set[int] = set()
    while True:
        tables, hashes = lane_hit(lambda h, key: _where(gpu, tiers, h, key, missing), chain(), windows, block_size)
        lower, waits, lost = _fetch_below(tiers, tables)
        if lost is None:
            break
        missing.add(lost)  # gone from its tier since it was seen: the hit without it
    if waits:
        return replace(NO_HIT, waits_on_disk=True)
    tables = [[BELOW if isinstance(e, Below) else e for e in table] for table in tables]
    hit = PrefixHit(tuple(map(tuple, tables)), tuple(hashes), 0, tuple(lower))
    return replace(hit, num_reclaimed=sum(1 for b in set(hit.held()) if gpu.is_cached_free(b)))


def _where(gpu: BlockPool, tiers: KvTiers | None, block_hash: int, key: tuple, missing: set[int]) -> int | Below | None:
    """Where a lane's copy of a block is: a device block, a tier below, or nowhere (None)."""
    block = gpu.lookup(block_hash, key)
    if block is not None:
        return block
    if tiers is not None and block_hash not in missing and tiers.holds(block_hash, key):
        return Below(block_hash, key)
    return None


def _fetch_below(tiers: KvTiers | None, tables: list[list]) -> tuple[list[LowerHit], bool, int | None]:
    """``(lower, waits, lost)``: the hit's blocks from below the device in table order; whether one
    is still being read from disk; the hash of one no tier has any more (None: none lost)."""
    lower: list[LowerHit] = []
    waits = False
    for entry in (e for table in tables for e in table if isinstance(e, Below)):
        found = tiers.find(entry.block_hash, entry.key)
        if found is None:
            return [], False, entry.block_hash
        if found == PENDING:
            waits = True
        else:
            lower.append(found)
    return lower, waits, None
