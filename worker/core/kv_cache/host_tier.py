"""The host tier under the prefix cache: slots of host memory that keep full blocks the device
pool evicted, by content hash, so a prompt that comes back later copies its prefix up instead of
recomputing it.

A slot is free or holds one block (hash and key). Slots are evicted least recently used first;
the slots a step reads (promotions) or writes (demotions) are pinned until that step's moves are
taken, so no later decision of the same step can reuse them before the copies run. The tier is
inclusive: a block promoted back to the device stays here as a clean copy, and its next eviction
from the device costs no copy.

Pure Python, no torch: ``worker/runner/kv_cache/tier_storage.py`` holds the bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple


class HostEntry(NamedTuple):
    slot: int
    block_hash: int
    key: tuple


class HostTier:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._entries: OrderedDict[int, HostEntry] = OrderedDict()  # hash -> entry, least recently used first
        self._pinned: set[int] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def lookup(self, block_hash: int, key: tuple) -> HostEntry | None:
        """The entry of ``block_hash`` whose key equals ``key`` (a collision is a miss)."""
        entry = self._entries.get(block_hash)
        return entry if entry is not None and entry.key == key else None

    def take_for_read(self, entry: HostEntry) -> None:
        """A promotion reads ``entry`` this step: most recently used, and pinned."""
        self._entries.move_to_end(entry.block_hash)
        self._pinned.add(entry.slot)

    def put(self, block_hash: int, key: tuple) -> tuple[HostEntry | None, HostEntry | None]:
        """A slot for a block the device evicts: ``(new entry, evicted entry)``. No new entry when
        the hash is here already (the copy is clean: nothing to write) or every slot is pinned."""
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return None, None
        evicted = None
        if not self._free:
            evicted = next((e for e in self._entries.values() if e.slot not in self._pinned), None)
            if evicted is None:
                return None, None
            del self._entries[evicted.block_hash]
            self._free.append(evicted.slot)
        entry = HostEntry(self._free.pop(), block_hash, key)
        self._entries[block_hash] = entry
        self._pinned.add(entry.slot)
        return entry, evicted

    def unpin_all(self) -> None:
        """The step's moves were taken: its slots may be reused from now on."""
        self._pinned.clear()

    def entries(self) -> list[HostEntry]:
        return list(self._entries.values())

    def check_invariants(self) -> None:
        slots = [e.slot for e in self._entries.values()]
        problems = []
        if len(set(slots)) != len(slots):
            problems.append("a slot holds two blocks")
        if set(slots) & set(self._free):
            problems.append(f"slots both free and used: {sorted(set(slots) & set(self._free))}")
        if len(slots) + len(self._free) != self.num_slots or len(set(self._free)) != len(self._free):
            problems.append(f"{len(slots)} used + {len(self._free)} free != {self.num_slots} slots")
        if any(h != e.block_hash for h, e in self._entries.items()):
            problems.append("an entry is filed under another hash")
        if not self._pinned <= set(slots):
            problems.append(f"pinned slots that hold nothing: {sorted(self._pinned - set(slots))}")
        if problems:
            raise AssertionError("host tier invariants broken: " + "; ".join(problems))
