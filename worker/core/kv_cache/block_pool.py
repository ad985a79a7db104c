"""One device's pool of physical KV blocks: reference counts, the free list, and the prefix cache.

A block is in exactly one of three states:

* **used**: reference count > 0 (held by one or more block tables);
* **free**: reference count 0, carries no content hash, ready to hand out;
* **cached**: reference count 0 but carries a content hash, so a later request with the same
  prefix can take it back. Cached blocks count as free capacity: when the plain free list is
  empty the least recently released cached block is evicted (its hash entry dropped) and reused.

Pure Python, no torch: the pool only does bookkeeping, the model runner moves the bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from pagedserve.worker.core.kv_cache.errors import OutOfBlocksError
from pagedserve.worker.core.kv_cache.kv_events import KvEvents

BLOCK_SIZE = 16  # tokens per KV block unless configured otherwise


class BlockPool:
    """Reference-counted blocks ``0 .. num_blocks-1`` of one device."""

    def __init__(self, num_blocks: int, *, name: str = "gpu") -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        # Popping from the end hands out low block ids first, which keeps tests readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU order: oldest first
        self._hash_of: dict[int, int] = {}
        self._key_of: dict[int, tuple] = {}
        self._block_of_hash: dict[int, int] = {}
        self._silent: set[int] = set()  # hashes not announced to ``events`` (a lane's own, kv_layout.py)
        self.events: KvEvents | None = None  # set by the worker: hashes published, lowered and dropped, for routing
        self.on_evict: Callable[[int, int, tuple], bool] | None = None  # (block, hash, key): the tiers demote it (kept?)

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (plain free + evictable cached)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def ref_counts(self) -> list[int]:
        """Each block's reference count (a copy)."""
        return list(self._ref)

    def cached_blocks(self) -> list[int]:
        """Blocks free but in the prefix cache, least recently released first."""
        return list(self._cached)

    def published_hashes(self) -> list[int]:
        """Every announced hash in the prefix cache (blocks in use and cached free ones)."""
        if not self._silent:
            return list(self._block_of_hash)
        return [h for h in self._block_of_hash if h not in self._silent]

    def is_cached_free(self, block: int) -> bool:
        return block in self._cached

    # ------------------------------------------------------------------ allocation
    def allocate(self) -> int:
        """Hand out one block with reference count 1, evicting the LRU cached block if needed."""
        if self._free:
            block = self._free.pop()
        elif self._cached:
            block, _ = self._cached.popitem(last=False)
            kept = self.on_evict is not None and self.on_evict(block, self._hash_of[block], self._key_of[block])
            self._drop_hash(block, kept)
        else:
            raise OutOfBlocksError(f"{self.name} pool exhausted ({self.num_blocks} blocks)")
        self._ref[block] = 1
        return block

    def incref(self, block: int) -> None:
        """Take one more reference; a cached free block comes back into use."""
        if self._ref[block] == 0:
            if block not in self._cached:
                raise ValueError(f"block {block} is free and uncached; allocate it instead")
            del self._cached[block]
        self._ref[block] += 1

    def decref(self, block: int) -> None:
        """Drop one reference; at zero the block becomes cached (if hashed) or free."""
        if self._ref[block] <= 0:
            raise ValueError(f"block {block} on {self.name} is not referenced")
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if block in self._hash_of:
                self._cached[block] = None  # most recently used goes last
            else:
                self._free.append(block)

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, block_hash: int, key: tuple) -> int | None:
        """The block registered under ``block_hash`` whose full key equals ``key``, else None."""
        block = self._block_of_hash.get(block_hash)
        if block is None or self._key_of[block] != key:
            return None  # a hash collision is a miss, never a wrong hit
        return block

    def register(self, block: int, block_hash: int, key: tuple, announce: bool = True) -> bool:
        """Publish a full, computed block under its content hash (told to ``events`` unless not
        ``announce``: a further lane's copy of a prefix the first lane announces). False if the hash
        is taken."""
        if block_hash in self._block_of_hash or block in self._hash_of:
            return False
        self._hash_of[block] = block_hash
        self._key_of[block] = key
        self._block_of_hash[block_hash] = block
        if not announce:
            self._silent.add(block_hash)
        elif self.events is not None:
            self.events.published(block_hash)
        return True

    def forget_cached(self) -> int:
        """Turn every cached free block into a plain free one (the prefix cache emptied, as between
        benchmark passes); blocks in use keep their hashes. How many were forgotten."""
        count = len(self._cached)
        while self._cached:
            block, _ = self._cached.popitem(last=False)
            self._drop_hash(block)
            self._free.append(block)
        return count

    def hashed_blocks(self) -> list[tuple[int, int, tuple]]:
        """``(block, hash, key)`` of every block in the prefix cache."""
        return [(block, block_hash, self._key_of[block]) for block, block_hash in self._hash_of.items()]

    def holds(self, block_hash: int) -> bool:
        return block_hash in self._block_of_hash

    def _drop_hash(self, block: int, kept_below: bool = False) -> None:
        block_hash = self._hash_of.pop(block)
        del self._key_of[block]
        del self._block_of_hash[block_hash]
        if block_hash in self._silent:
            self._silent.discard(block_hash)
        elif self.events is not None:
            (self.events.lowered if kept_below else self.events.dropped)(block_hash)

    # ------------------------------------------------------------------ checks
    def check_invariants(self, table_refs: dict[int, int]) -> None:
        """Raise AssertionError if the pool disagrees with ``table_refs`` (block -> references)."""
        problems: list[str] = []
        for block in range(self.num_blocks):
            if self._ref[block] != table_refs.get(block, 0):
                problems.append(f"block {block}: ref {self._ref[block]} != {table_refs.get(block, 0)} table refs")
        free, cached = set(self._free), set(self._cached)
        if len(free) != len(self._free):
            problems.append("duplicate entries in the free list")
        if free & cached:
            problems.append(f"blocks both free and cached: {sorted(free & cached)}")
        for block in free | cached:
            if self._ref[block] != 0:
                problems.append(f"block {block} is free but has ref {self._ref[block]}")
        if self.num_free + sum(1 for r in self._ref if r > 0) != self.num_blocks:
            problems.append("free + used != total")
        for block in free:
            if block in self._hash_of:
                problems.append(f"plain free block {block} still carries a hash")
        for block in cached:
            if block not in self._hash_of:
                problems.append(f"cached block {block} has no hash")
        for block_hash, block in self._block_of_hash.items():
            if self._hash_of.get(block) != block_hash:
                problems.append(f"hash map entry {block_hash} -> {block} is stale")
        if len(self._hash_of) != len(self._block_of_hash) or len(self._key_of) != len(self._hash_of):
            problems.append("hash maps differ in size")
        if problems:
            raise AssertionError(f"{self.name} pool invariants broken: " + "; ".join(problems[:10]))
