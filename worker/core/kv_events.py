"""What the prefix cache gained and lost since it was last asked: the hashes of full blocks
published (a later prompt with that prefix can hit them) and dropped (evicted, or forgotten).

The worker turns each ``take`` into one KV event on Redis, from which gateways know which worker
holds which prefix (``gateway/kv_index.py``). Recording is off unless a ``KvEvents`` is attached
to the GPU pool (``BlockPool.events``); the offline ``LLM`` never attaches one.
"""

from __future__ import annotations


class KvEvents:
    def __init__(self) -> None:
        self._changes: dict[int, bool] = {}  # hash -> True: published, False: dropped (net, in order)
        self._reset = False

    def reset(self, published: list[int]) -> None:
        """Forget what was recorded: the cache holds exactly ``published`` (a resync)."""
        self._changes = dict.fromkeys(published, True)
        self._reset = True

    def published(self, block_hash: int) -> None:
        self._changes[block_hash] = True

    def dropped(self, block_hash: int) -> None:
        if self._changes.get(block_hash) is True:
            del self._changes[block_hash]  # published and dropped since the last take: nobody needs to know
        else:
            self._changes[block_hash] = False

    def add(self, published: list[int], dropped: list[int], reset: bool) -> None:
        """Fold in another recorder's ``take`` (the worker merges the engine thread's between sends)."""
        if reset:
            self.reset(published)
            return
        for block_hash in published:
            self.published(block_hash)
        for block_hash in dropped:
            self.dropped(block_hash)

    def __bool__(self) -> bool:
        return bool(self._changes) or self._reset

    def take(self) -> tuple[list[int], list[int], bool]:
        """``(published, dropped, reset)`` since the last call; ``reset``: the published ones are
        all the cache holds."""
        changes, reset, self._changes, self._reset = self._changes, self._reset, {}, False
        return [h for h, kept in changes.items() if kept], [h for h, kept in changes.items() if not kept], reset
