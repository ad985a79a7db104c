"""KV events on the wire: what one worker's prefix cache gained and lost (block hashes from
``shared/block_hash.py``), one msgpack entry per flush on the model's ``kv`` stream.

``reset``: the worker's cache is empty (it started, or it is leaving); readers forget every hash
they had for it before applying the entry's own lists.
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

    def encode(self) -> bytes:
        return pack({"w": self.worker, "p": self.published, "d": self.dropped, "r": self.reset})

    @classmethod
    def decode(cls, data: bytes) -> "KvEvent":
        try:
            msg = unpack(data)
            worker, published, dropped, reset = msg["w"], msg["p"], msg["d"], msg["r"]
        except Exception as err:
            raise InvalidRequestError(f"unreadable KV event: {err}") from None
        if not isinstance(worker, str) or not isinstance(reset, bool) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in (*published, *dropped)):
            raise InvalidRequestError("a KV event holds a worker name, hash lists and a reset flag")
        return cls(worker, list(published), list(dropped), reset)
