"""The tiers under the device pool's prefix cache, and the copies one step makes between them.

A full block the device pool evicts is demoted (to the host tier; when the host tier evicts it in
turn, or when there is no host tier, spilled to the disk tier) instead of dropped. A prompt whose
prefix goes on below the device finds it here: a host hit is promoted (copied up before the step's
forward), a disk hit is read in the background while the request waits and later steps run, then
loaded. Every block keeps its content hash and key through every tier and is found only by both.

With KV events attached (a worker that routes), a demoted block is reported lowered, and a block
that leaves the last tier holding it (and is not on the device) dropped; a further lane's copy of a
block (``lane_hits.py``) is kept and found as any, never reported.

Pure Python, no torch: the step's ``TierMoves`` carry the copies to the runner
(``worker/runner/kv_cache/tier_storage.py``), which applies them before anything else touches the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from pagedserve.worker.core.kv_cache.disk_tier import DiskTier
from pagedserve.worker.core.kv_cache.host_tier import HostEntry, HostTier
from pagedserve.worker.core.kv_cache.kv_events import KvEvents
from pagedserve.worker.core.kv_cache.lane_hits import is_lane_hash


@dataclass(frozen=True)
class TierMoves:
    """One step's copies between the device pool and the tiers under it (``host_tier.py``,
    ``disk_tier.py``; the plan carries them to the runner), applied before every other block move:
    spills (host slots, or device blocks when there is no host tier, written to disk), demotions
    (device block -> host slot), then, after the swap-outs, promotions (host slot -> device block)
    and loads (a disk payload -> device block)."""

    spills: tuple[tuple[str, int, int, tuple], ...] = ()  # ("host" | "gpu", slot or block, hash, key)
    demotions: tuple[tuple[int, int], ...] = ()  # (device block, host slot)
    promotions: tuple[tuple[int, int], ...] = ()  # (host slot, device block)
    loads: tuple[tuple[bytes, int], ...] = ()  # (payload, device block)

    def __bool__(self) -> bool:
        return bool(self.spills or self.demotions or self.promotions or self.loads)


NO_TIER_MOVES = TierMoves()


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
        self.events: KvEvents | None = None  # set with the device pool's: what leaves the last tier is dropped
        self.on_device: Callable[[int], bool] = lambda block_hash: False  # the block manager's device pool

    def demote(self, block: int, block_hash: int, key: tuple) -> bool:
        """The device pool evicts ``block``: keep its content below (its bytes are copied before
        anything of this step writes the block). Whether a tier keeps it (a spill not yet written
        counts as kept: a failed write is reported when the disk tier gives it up)."""
        if self.host is not None and self.host.num_slots:
            entry, evicted = self.host.put(block_hash, key)
            if evicted is not None and self.disk is not None:
                self._spill("host", evicted.slot, evicted.block_hash, evicted.key)
            elif evicted is not None:
                self._gone(evicted.block_hash)
            if entry is not None:
                self._moves.demotions.append((block, entry.slot))
                self.stats.demotions += 1
                return True
            if self.host.lookup(block_hash, key) is not None:
                return True  # a clean copy is there already
        if self.disk is None:  # no host tier, or every host slot pinned by this step
            self.stats.dropped += 1
            return False
        if block_hash not in self.disk:
            self._spill("gpu", block, block_hash, key)
        return True

    def write_back(self, device_blocks: list[tuple[int, int, tuple]]) -> list[tuple]:
        """The spills that leave the disk tier holding every block the device (``(block, hash,
        key)``) and the host tier hold: what a worker that stops writes before it goes."""
        if self.disk is None:
            return []
        held = [("gpu", block, h, key) for block, h, key in device_blocks]
        held += [("host", e.slot, e.block_hash, e.key) for e in (self.host.entries() if self.host is not None else ())]
        spills = {h: (source, index, h, key) for source, index, h, key in held if h not in self.disk}
        return list(spills.values())

    def _spill(self, source: str, index: int, block_hash: int, key: tuple) -> None:
        self._moves.spills.append((source, index, block_hash, key))
        self.stats.spills += 1

    def _gone(self, block_hash: int) -> None:
        """A tier let ``block_hash`` go: dropped for routing unless something still holds it."""
        if self.events is None or is_lane_hash(block_hash) or self.on_device(block_hash):
            return
        if (self.host is not None and block_hash in self.host) or (self.disk is not None and block_hash in self.disk):
            return
        self.events.dropped(block_hash)

    def report_gone(self) -> None:
        """Tell the KV events what the disk tier gave up since the last call (its threads evict,
        find damage, skip writes; the engine thread reports)."""
        if self.disk is not None:
            self.disk.refresh()
            for block_hash in self.disk.take_gone():
                self._gone(block_hash)

    def lowered_hashes(self) -> list[int]:
        """Every hash a tier below holds that the device does not (for a KV events resync)."""
        held = dict.fromkeys(e.block_hash for e in self.host.entries()) if self.host is not None else {}
        held.update(dict.fromkeys(self.disk.hashes()) if self.disk is not None else {})
        return [h for h in held if not is_lane_hash(h) and not self.on_device(h)]

    def holds(self, block_hash: int, key: tuple) -> bool:
        """Whether a tier has the block (nothing is read: ``find`` does that)."""
        if self.host is not None and self.host.lookup(block_hash, key) is not None:
            return True
        return self.disk is not None and (block_hash in self.disk or self.disk.take_ready(block_hash, key, keep=True) is not None)

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
        self.report_gone()
        if not (moves.spills or moves.demotions or moves.promotions or moves.loads):
            return NO_TIER_MOVES
        return TierMoves(tuple(moves.spills), tuple(moves.demotions), tuple(moves.promotions), tuple(moves.loads))

    def check_invariants(self) -> None:
        if self.host is not None:
            self.host.check_invariants()
