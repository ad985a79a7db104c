"""What the prefix cache gained and lost since it was last asked: the hashes of full blocks
published (on the device: a later prompt with that prefix can hit them), lowered (evicted from the
device but kept by a tier below it: a hit there costs a copy up, not a recompute) and dropped (held
nowhere any more).

The worker turns each ``take`` into one KV event on Redis, from which gateways know which worker
holds which prefix, and where (``gateway/routing/kv_index.py``). Recording is off unless a ``KvEvents`` is
attached to the GPU pool (``BlockPool.events``); the offline ``LLM`` never attaches one.
"""

from __future__ import annotations

from typing import NamedTuple

PUBLISHED, LOWERED, DROPPED = "p", "l", "d"


class KvChanges(NamedTuple):
    published: list[int]
    dropped: list[int]
    reset: bool  # the published and lowered ones are all the cache holds
    lowered: list[int] = []


class KvEvents:
    def __init__(self) -> None:
        self._changes: dict[int, str] = {}  # hash -> its last state since the last take
        self._reset = False

    def reset(self, published: list[int], lowered: list[int] = ()) -> None:
        """Forget what was recorded: the cache holds exactly ``published`` and ``lowered`` (a resync)."""
        self._changes = {**dict.fromkeys(lowered, LOWERED), **dict.fromkeys(published, PUBLISHED)}
        self._reset = True

    def published(self, block_hash: int) -> None:
        self._changes[block_hash] = PUBLISHED

    def lowered(self, block_hash: int) -> None:
        self._changes[block_hash] = LOWERED

    def dropped(self, block_hash: int) -> None:
        if self._reset and self._changes.get(block_hash) is not None:
            del self._changes[block_hash]  # a reset's reader knows nothing it does not list
        elif not self._reset:
            self._changes[block_hash] = DROPPED

    def add(self, changes: KvChanges) -> None:
        """Fold in another recorder's ``take`` (the worker merges the engine thread's between sends)."""
        if changes.reset:
            self.reset(changes.published, changes.lowered)
            return
        for block_hash in changes.published:
            self.published(block_hash)
        for block_hash in changes.lowered:
            self.lowered(block_hash)
        for block_hash in changes.dropped:
            self.dropped(block_hash)

    def __bool__(self) -> bool:
        return bool(self._changes) or self._reset

    def take(self) -> KvChanges:
        """What changed since the last call, each hash in the list of its last state."""
        changes, reset, self._changes, self._reset = self._changes, self._reset, {}, False
        by_state: dict[str, list[int]] = {PUBLISHED: [], LOWERED: [], DROPPED: []}
        for block_hash, state in changes.items():
            by_state[state].append(block_hash)
        return KvChanges(by_state[PUBLISHED], by_state[DROPPED], reset, by_state[LOWERED])
