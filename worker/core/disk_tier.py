"""The disk tier under the host tier: full KV blocks as files in a directory, bounded in bytes,
found again by a worker started later on the same directory and model.

One file per block, named by its content hash, under a folder named by the engine's fingerprint
(model, dtype, cache format, block shape: a block is only ever read back into the layout that
wrote it). A file holds a header (magic, hash, key length, payload length, a blake2b digest of key
and payload), the block's key (its parent hash, tokens and salt) and the payload. A file is written
beside its final name and renamed into place, so a process killed mid-write leaves at most a
temporary file, never a half-written block under a block's name; a file that is truncated,
corrupted or holds another key is deleted when read and counted, and the prompt recomputes.

Reads and writes run on two background threads: the engine thread asks for a block
(``request``), goes on stepping other requests, and finds the payload ready later
(``take_ready``). Workers may share a directory: renames are atomic and every read is verified,
so one never serves another's half-written or deleted file; each bounds the bytes it has seen.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
from array import array
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"PSKVBLK1"
HEADER = struct.Struct("<8sQIQ16s")  # magic, hash, key length, payload length, digest
SUFFIX = ".kv"
STALE_TEMP_S = 3600.0  # a temporary file this old belongs to no live writer
READY_BYTES = 256 << 20  # payloads read and not yet taken (their requests may have gone), at most


def key_bytes(key: tuple) -> bytes:
    """A block key ``(parent hash, tokens, salt)`` as bytes, the same in every process (what
    ``shared.block_hash.block_hash`` digests)."""
    parent, tokens, salt = key
    return (b"-" if parent is None else parent.to_bytes(8, "little")) + array("q", tokens).tobytes() + repr(salt).encode()


@dataclass
class DiskStats:
    writes: int = 0
    reads: int = 0
    corrupt: int = 0  # files that failed verification (deleted)
    evictions: int = 0
    read_seconds: float = 0.0


class DiskTier:
    def __init__(self, directory: Path, fingerprint: str, max_bytes: int, payload_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.root = Path(directory) / hashlib.blake2b(fingerprint.encode(), digest_size=10).hexdigest()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            (self.root / "fingerprint.txt").write_text(fingerprint + "\n")
        except OSError as err:
            raise ValueError(f"cannot use {directory} for the KV disk tier: {err}") from err
        self.max_bytes, self.payload_bytes = max_bytes, payload_bytes
        self.stats = DiskStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[int, int] = OrderedDict()  # hash -> file bytes, least recently used first
        self._ready: OrderedDict[int, tuple[bytes, bytes]] = OrderedDict()  # hash -> (key bytes, payload)
        self._inflight: set[int] = set()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-read")
        self._scan()

    # ------------------------------------------------------------------ the engine thread's calls
    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._index

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return sum(self._index.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def write(self, block_hash: int, key: tuple, payload: bytes) -> None:
        """Store a block (in the background); already stored, nothing happens."""
        if block_hash in self or len(payload) != self.payload_bytes:
            return
        self._writer.submit(self._write, block_hash, key_bytes(key), payload)

    def request(self, block_hash: int) -> bool:
        """Start reading a stored block; False when it is not stored here."""
        with self._lock:
            if block_hash in self._ready or block_hash in self._inflight:
                return True
            if block_hash not in self._index:
                return False
            self._inflight.add(block_hash)
        self._reader.submit(self._read, block_hash)
        return True

    def pending(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._inflight

    def take_ready(self, block_hash: int, key: tuple, keep: bool = False) -> bytes | None:
        """The payload of a block read and verified, if its key is ``key``; handed over (forgotten
        here) unless ``keep``."""
        with self._lock:
            ready = self._ready.get(block_hash)
            if ready is None or ready[0] != key_bytes(key):
                return None
            if not keep:
                del self._ready[block_hash]
            return ready[1]

    def flush(self) -> None:
        """Wait for the writes and reads asked for so far."""
        self._writer.submit(lambda: None).result()
        self._reader.submit(lambda: None).result()

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ background threads
    def _path(self, block_hash: int) -> Path:
        return self.root / f"{block_hash:016x}{SUFFIX}"

    def _scan(self) -> None:
        """Index the blocks a worker before this one left (oldest first); clear stale temporaries."""
        now, found = time.time(), []
        for path in self.root.iterdir():
            try:
                stat = path.stat()
                if path.suffix == SUFFIX:
                    found.append((stat.st_mtime, int(path.stem, 16), stat.st_size))
                elif path.suffix == ".tmp" and now - stat.st_mtime > STALE_TEMP_S:
                    path.unlink()
            except (OSError, ValueError):
                continue
        for _, block_hash, size in sorted(found):
            self._index[block_hash] = size
        self._evict_over_bound()

    def _write(self, block_hash: int, key: bytes, payload: bytes) -> None:
        digest = hashlib.blake2b(key, digest_size=16)
        digest.update(payload)
        data = b"".join((HEADER.pack(MAGIC, block_hash, len(key), len(payload), digest.digest()), key, payload))
        if len(data) > self.max_bytes:
            return
        target = self._path(block_hash)
        partial = target.with_name(f".{target.stem}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            partial.write_bytes(data)
            os.replace(partial, target)
        except OSError:
            partial.unlink(missing_ok=True)
            return
        with self._lock:
            self._index[block_hash] = len(data)
            self.stats.writes += 1
            self._evict_over_bound()

    def _evict_over_bound(self) -> None:
        total = sum(self._index.values())
        while total > self.max_bytes and self._index:
            block_hash, size = self._index.popitem(last=False)
            total -= size
            self._path(block_hash).unlink(missing_ok=True)
            self.stats.evictions += 1

    def _read(self, block_hash: int) -> None:
        started = time.perf_counter()
        result = self._verified(block_hash)
        with self._lock:
            self._inflight.discard(block_hash)
            self.stats.read_seconds += time.perf_counter() - started
            if not result:  # None: gone (another worker's eviction); False: failed verification
                self._index.pop(block_hash, None)
                self.stats.corrupt += result is False
                return
            self.stats.reads += 1
            self._index.move_to_end(block_hash, last=True)
            self._ready[block_hash] = result
            while len(self._ready) > max(8, READY_BYTES // max(1, self.payload_bytes)):
                self._ready.popitem(last=False)

    def _verified(self, block_hash: int) -> tuple[bytes, bytes] | bool | None:
        """(key bytes, payload) of a file whose header, length and digest all check out; False for
        a file that fails (deleted); None for one that is gone (another worker deleted it)."""
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError:
            data = b""
        ok = len(data) >= HEADER.size
        if ok:
            magic, stored_hash, key_len, payload_len, digest = HEADER.unpack_from(data)
            body = data[HEADER.size :]
            ok = (magic == MAGIC and stored_hash == block_hash and len(body) == key_len + payload_len
                  and payload_len == self.payload_bytes and hashlib.blake2b(body, digest_size=16).digest() == digest)
        if not ok:
            path.unlink(missing_ok=True)
            return False
        return body[:key_len], body[key_len:]
