"""The disk tier under the host tier: full KV blocks as files in a directory, bounded in bytes,
found again by a worker started later on the same directory and model.

One file per block, named by its content hash, under a folder named by the engine's fingerprint
(model, dtype, cache format, block shape: a block is only ever read back into the layout that
wrote it). A file holds a header (magic, hash, key length, payload length, a CRC-32 of key and
payload: it guards against truncation and damage, not forgery; the directory is the worker's own),
the block's key (its parent hash, tokens and salt) and the payload. A file is written beside its
final name and renamed into place, so a process killed mid-write leaves at most a temporary file,
never a half-written block under a block's name; a file that is truncated, corrupted or holds
another key is deleted when read and counted, and the prompt recomputes.

Reads and writes run on two background threads: the engine thread asks for a block
(``request``), goes on stepping other requests, and finds the payload ready later
(``take_ready``). Writes are best effort and never slow the forward: the writer runs at idle CPU
priority (``SCHED_IDLE``: only on a core nothing else wants), and a spill that finds
``WRITE_BACKLOG_BYTES`` already waiting is skipped (counted) rather than queued without bound.

Workers may share a directory: renames are atomic and every read is verified, so one never serves
another's half-written or deleted file, and each looks at the directory again every ``RESCAN_S``
(``refresh``): it finds the blocks the others wrote and forgets the ones they evicted, so every
worker's byte bound applies to the directory as a whole.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
import zlib
from array import array
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"PSKVBLK2"
HEADER = struct.Struct("<8sQIQI")  # magic, hash, key length, payload length, CRC-32 of key and payload
SUFFIX = ".kv"
STALE_TEMP_S = 3600.0  # a temporary file this old belongs to no live writer
READY_BYTES = 256 << 20  # payloads read and not yet taken (their requests may have gone), at most
WRITE_BACKLOG_BYTES = 64 << 20  # payloads handed to the writer and not yet on disk, at most
RESCAN_S = 5.0  # how often a worker looks for the blocks other workers on its directory wrote or evicted


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
    skipped: int = 0  # spills not written: the writer's backlog was full
    read_seconds: float = 0.0


def _idle_priority() -> None:
    """Run the calling thread only when a core is otherwise idle (Linux; elsewhere a no-op)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


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
        self._bytes = 0  # the sum of ``_index``'s values
        self._backlog = 0  # payload bytes queued for the writer
        self._ready: OrderedDict[int, tuple[bytes, bytes]] = OrderedDict()  # hash -> (key bytes, payload)
        self._inflight: set[int] = set()
        self._gone: list[int] = []  # hashes given up (evicted, damaged, not written) since ``take_gone``
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-write", initializer=_idle_priority)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-read")
        self._rescan_at = time.monotonic() + RESCAN_S
        self._scan()

    # ------------------------------------------------------------------ the engine thread's calls
    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._index

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def hashes(self) -> list[int]:
        with self._lock:
            return list(self._index)

    def take_gone(self) -> list[int]:
        """The hashes this tier gave up since the last call: evicted, found damaged, or never
        written (the writer's backlog was full, the disk refused)."""
        with self._lock:
            gone, self._gone = self._gone, []
        return gone

    def write(self, block_hash: int, key: tuple, payload, wait: bool = False) -> None:
        """Store a block (in the background) from ``payload``, a bytes-like object the caller no
        longer writes to; already stored, nothing happens; the writer too far behind, nothing
        happens either, unless ``wait``: then the caller waits for it to catch up."""
        size = memoryview(payload).nbytes
        if block_hash in self or size != self.payload_bytes:
            return
        if wait and self._backlog + size > WRITE_BACKLOG_BYTES:
            self._writer.submit(lambda: None).result()
        with self._lock:
            if self._backlog + size > WRITE_BACKLOG_BYTES:
                self.stats.skipped += 1
                self._gone.append(block_hash)
                return
            self._backlog += size
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

    def refresh(self, now: bool = False) -> None:
        """Look at the directory again (on the writer thread) if ``RESCAN_S`` passed, or ``now``."""
        if now or time.monotonic() >= self._rescan_at:
            self._rescan_at = time.monotonic() + RESCAN_S
            self._writer.submit(self._scan)

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
        """Index the blocks other workers (before this one, or beside it) wrote, as most recently
        used (oldest first among them); forget the ones whose files are gone; clear stale
        temporaries. At start, or on the writer thread: this worker's own writes cannot race it."""
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
        on_disk = {block_hash for _, block_hash, _ in found}
        with self._lock:
            for block_hash in [h for h in self._index if h not in on_disk and h not in self._inflight]:
                self._forget(block_hash)
            for _, block_hash, size in sorted(found):
                if block_hash not in self._index:
                    self._index[block_hash] = size
                    self._bytes += size
            self._evict_over_bound()

    def _write(self, block_hash: int, key: bytes, payload) -> None:
        written = False
        try:
            written = self._write_file(block_hash, key, memoryview(payload).cast("B"))
        finally:
            with self._lock:
                self._backlog -= self.payload_bytes
                if not written:
                    self._gone.append(block_hash)

    def _write_file(self, block_hash: int, key: bytes, payload: memoryview) -> bool:
        header = HEADER.pack(MAGIC, block_hash, len(key), len(payload), zlib.crc32(payload, zlib.crc32(key)))
        size = len(header) + len(key) + len(payload)
        if size > self.max_bytes:
            return False
        target = self._path(block_hash)
        partial = target.with_name(f".{target.stem}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            self._write_parts(partial, (header, key, payload))
            os.replace(partial, target)
        except OSError:
            partial.unlink(missing_ok=True)
            return False
        with self._lock:
            self._bytes += size - self._index.get(block_hash, 0)
            self._index[block_hash] = size
            self.stats.writes += 1
            self._evict_over_bound()
        return True

    @staticmethod
    def _write_parts(path: Path, parts: tuple) -> None:
        with open(path, "wb") as out:
            for part in parts:
                out.write(part)

    def _forget(self, block_hash: int) -> None:
        self._bytes -= self._index.pop(block_hash, 0)
        self._gone.append(block_hash)

    def _evict_over_bound(self) -> None:
        while self._bytes > self.max_bytes and self._index:
            block_hash = next(iter(self._index))
            self._forget(block_hash)
            self._path(block_hash).unlink(missing_ok=True)
            self.stats.evictions += 1

    def _read(self, block_hash: int) -> None:
        started = time.perf_counter()
        result = self._verified(block_hash)
        with self._lock:
            self._inflight.discard(block_hash)
            self.stats.read_seconds += time.perf_counter() - started
            if not result:  # None: gone (another worker's eviction); False: failed verification
                self._forget(block_hash)
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
                  and payload_len == self.payload_bytes and zlib.crc32(body) == digest)
        if not ok:
            path.unlink(missing_ok=True)
            return False
        return body[:key_len], body[key_len:]
