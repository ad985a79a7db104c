"""Content hashes of full KV blocks, the same in every process: the worker's prefix cache keys its
blocks by them and publishes them (KV events), and the gateway computes a prompt's chain to route
it to the worker that holds its prefix.

A block's hash covers its parent's hash (so equal blocks after different prefixes differ), its
token ids and a salt (the request's tenant, and under long-rope which factors rotated the KV:
``cache_salt``). blake2b, 63 bits: Python's own ``hash`` is salted per process for strings.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Hashable, Sequence


def cache_salt(tenant: str | None, num_tokens: int, rope_switch: int = 0) -> Hashable:
    """What a block's hash is salted with besides its tokens: the tenant (``user``), and with
    long-rope (``rope_switch`` > 0) whether the sequence was past the switch (long factors)."""
    return (tenant, num_tokens > rope_switch) if rope_switch else tenant


def block_hash(parent: int | None, tokens: Sequence[int], salt: Hashable = None) -> int:
    digest = hashlib.blake2b(digest_size=8)
    digest.update(b"-" if parent is None else parent.to_bytes(8, "little"))
    digest.update(array("q", tokens).tobytes())
    if salt is not None:
        digest.update(repr(salt).encode())
    return int.from_bytes(digest.digest(), "little") >> 1


def prefix_hashes(token_ids: Sequence[int], block_size: int, salt: Hashable = None) -> list[int]:
    """The chained hashes of the prompt's full blocks a prefix hit can cover (the last token is
    always computed, so a prompt of exactly ``k`` blocks has ``k - 1``)."""
    hashes: list[int] = []
    parent = None
    for i in range((len(token_ids) - 1) // block_size):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size], salt)
        hashes.append(parent)
    return hashes
