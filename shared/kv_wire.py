"""KV events on the wire: what one worker's prefix cache gained and lost (block hashes from
``shared/block_hash.py``), one msgpack entry per flush on the model's ``kv`` stream.

``published``: on the worker's device; ``lowered``: evicted from the device but kept by a tier
below it (host memory, disk: a hit costs a copy up, not a recompute); ``dropped``: held nowhere.
Each hash is in at most one list. ``reset``: the worker's cache holds exactly this entry's lists
(it started, resynced, or is leaving with empty lists); readers forget every hash they had for it
first. An entry from a worker older than ``lowered`` simply lacks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.protocol import pack, unpack


@dataclass(frozen=True)
class KvEvent:
    worker: str
    published: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    reset: bool = False
    lowered: list[int] = field(default_factory=list)

    def encode(self) -> bytes:
        return pack({"w": self.worker, "p": self.published, "d": self.dropped, "r": self.reset, "l": self.lowered})

    @classmethod
    def decode(cls, data: bytes) -> "KvEvent":
        try:
            msg = unpack(data)
            worker, published, dropped, reset, lowered = msg["w"], msg["p"], msg["d"], msg["r"], msg.get("l", [])
        except Exception as err:
            raise InvalidRequestError(f"unreadable KV event: {err}") from None
        if not isinstance(worker, str) or not isinstance(reset, bool) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in (*published, *dropped, *lowered)):
            raise InvalidRequestError("a KV event holds a worker name, hash lists and a reset flag")
        return cls(worker, list(published), list(dropped), reset, list(lowered))
