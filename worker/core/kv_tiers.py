"""The tiers under the device pool's prefix cache, and the copies one step makes between them.

A full block the device pool evicts is demoted (to the host tier; when the host tier evicts it in
turn, or when there is no host tier, spilled to the disk tier) instead of dropped. A prompt whose
prefix goes on below the device finds it here: a host hit is promoted (copied up before the step's
forward), a disk hit is read in the background while the request waits and later steps run, then
loaded. Every block keeps its content hash and key through every tier and is found only by both.

Pure Python, no torch: the step's ``TierMoves`` carry the copies to the runner
(``worker/runner/kv_tiers.py``), which applies them before anything else touches the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pagedserve.worker.core.disk_tier import DiskTier
from pagedserve.worker.core.host_tier import HostEntry, HostTier
from pagedserve.worker.core.plan import NO_TIER_MOVES, TierMoves


class LowerHit(NamedTuple):
    """A prefix block found below the device: in a host slot, or read from disk (its payload)."""
    block_hash: int
    key: tuple
    host: HostEntry | None
    payload: bytes | None


PENDING = "pending"  # the block is on disk and being read: the request waits


@dataclass
class TierStats:
    demotions: int = 0
    spills: int = 0
    host_hits: int = 0  # blocks promoted from the host tier
    disk_hits: int = 0  # blocks loaded from the disk tier
    dropped: int = 0  # evicted blocks no tier could take


@dataclass
class _Moves:
    spills: list = field(default_factory=list)
    demotions: list = field(default_factory=list)
    promotions: list = field(default_factory=list)
    loads: list = field(default_factory=list)


class KvTiers:
    def __init__(self, host: HostTier | None, disk: DiskTier | None) -> None:
        self.host, self.disk = host, disk
        self.stats = TierStats()
        self._moves = _Moves()

    def demote(self, block: int, block_hash: int, key: tuple) -> None:
        """The device pool evicts ``block``: keep its content below (its bytes are copied before
        anything of this step writes the block)."""
        if self.host is not None and self.host.num_slots:
            entry, evicted = self.host.put(block_hash, key)
            if evicted is not None and self.disk is not None:
                self._moves.spills.append(("host", evicted.slot, evicted.block_hash, evicted.key))
                self.stats.spills += 1
            if entry is not None:
                self._moves.demotions.append((block, entry.slot))
                self.stats.demotions += 1
            elif self.host.lookup(block_hash, key) is None:
                self.stats.dropped += 1
        elif self.disk is not None:
            if block_hash not in self.disk:
                self._moves.spills.append(("gpu", block, block_hash, key))
                self.stats.spills += 1

    def find(self, block_hash: int, key: tuple) -> LowerHit | str | None:
        """The block below the device, ``PENDING`` while it is read from disk, else None."""
        if self.host is not None:
            entry = self.host.lookup(block_hash, key)
            if entry is not None:
                return LowerHit(block_hash, key, entry, None)
        if self.disk is None:
            return None
        payload = self.disk.take_ready(block_hash, key, keep=True)
        if payload is not None:
            return LowerHit(block_hash, key, None, payload)
        return PENDING if self.disk.request(block_hash) else None

    def prefetch(self, block_hash: int) -> bool:
        """Start reading a block from disk ahead of need; False when the disk tier lacks it."""
        return self.disk is not None and self.disk.request(block_hash)

    def hold(self, hits: list[LowerHit]) -> None:
        """These hits will be promoted this step: their host slots may not be reused before."""
        for hit in hits:
            if hit.host is not None:
                self.host.take_for_read(hit.host)

    def promote(self, hit: LowerHit, block: int) -> None:
        """Copy ``hit`` up into the device's ``block`` this step."""
        if hit.host is not None:
            self._moves.promotions.append((hit.host.slot, block))
            self.stats.host_hits += 1
        else:
            self.disk.take_ready(hit.block_hash, hit.key)
            self._moves.loads.append((hit.payload, block))
            self.stats.disk_hits += 1

    def take_moves(self) -> TierMoves:
        """This step's copies, in the order the runner applies them; its pins are released."""
        moves, self._moves = self._moves, _Moves()
        if self.host is not None:
            self.host.unpin_all()
        if not (moves.spills or moves.demotions or moves.promotions or moves.loads):
            return NO_TIER_MOVES
        return TierMoves(tuple(moves.spills), tuple(moves.demotions), tuple(moves.promotions), tuple(moves.loads))

    def check_invariants(self) -> None:
        if self.host is not None:
            self.host.check_invariants()
