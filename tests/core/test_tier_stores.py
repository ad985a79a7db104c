"""The host tier's slots and the disk tier's files on their own: eviction order and pins; a file
truncated, corrupted, holding another key, or half-written by a process killed mid-write is never
served; the byte bound; a restart finds what the last process wrote."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest

from pagedserve.worker.core.kv_cache import disk_tier
from pagedserve.worker.core.kv_cache.disk_tier import DiskTier
from pagedserve.worker.core.kv_cache.host_tier import HostTier

KEY = (None, (1, 2, 3), None)
PAYLOAD = bytes(range(64))


def read(disk: DiskTier, block_hash: int, key=KEY) -> bytes | None:
    assert disk.request(block_hash)
    disk.flush()
    return disk.take_ready(block_hash, key)


def test_the_host_tier_evicts_the_least_recently_used_unpinned_slot():
    host = HostTier(2)
    a, _ = host.put(1, ("a",))
    b, _ = host.put(2, ("b",))
    host.unpin_all()
    assert host.put(1, ("a",)) == (None, None)  # already here: a clean copy, used again
    host.unpin_all()
    c, evicted = host.put(3, ("c",))
    assert evicted == b and c.slot == b.slot and host.lookup(2, ("b",)) is None
    host.take_for_read(host.lookup(1, ("a",)))  # promoted this step: pinned with c
    assert host.put(4, ("d",)) == (None, None)  # every slot pinned: nothing is overwritten
    assert host.lookup(1, ("other key",)) is None
    host.check_invariants()


def test_a_block_written_is_read_back_by_hash_and_key_only(tmp_path):
    disk = DiskTier(tmp_path, "m", 1 << 20, len(PAYLOAD))
    disk.write(7, KEY, PAYLOAD)
    disk.write(8, KEY, PAYLOAD[:-1])  # not a block of this layout: refused
    disk.flush()
    assert 7 in disk and 8 not in disk and not disk.request(8)
    assert disk.request(7)
    disk.flush()
    assert disk.take_ready(7, (None, (1, 2, 4), None)) is None  # another key (a hash collision): a miss
    assert disk.take_ready(7, KEY, keep=True) == PAYLOAD
    assert disk.take_ready(7, KEY) == PAYLOAD and disk.take_ready(7, KEY) is None  # handed over once


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "flip the magic", "empty"])
def test_a_damaged_file_is_deleted_and_counted_never_served(tmp_path, damage):
    disk = DiskTier(tmp_path, "m", 1 << 20, len(PAYLOAD))
    disk.write(7, KEY, PAYLOAD)
    disk.flush()
    path = next(disk.root.glob("*.kv"))
    data = bytearray(path.read_bytes())
    if damage == "flip a payload byte":
        data[-5] ^= 0x40
    elif damage == "truncate":
        data = data[:-10]
    elif damage == "flip the magic":
        data[0] ^= 1
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    assert read(disk, 7) is None
    assert disk.stats.corrupt == 1 and 7 not in disk and not path.exists()


def test_a_file_another_worker_deleted_is_a_plain_miss(tmp_path):
    disk = DiskTier(tmp_path, "m", 1 << 20, len(PAYLOAD))
    disk.write(7, KEY, PAYLOAD)
    disk.flush()
    next(disk.root.glob("*.kv")).unlink()
    assert read(disk, 7) is None and disk.stats.corrupt == 0 and 7 not in disk


def test_two_live_workers_on_one_directory_find_each_others_blocks_and_share_the_bound(tmp_path):
    one = DiskTier(tmp_path, "m", 1 << 20, len(PAYLOAD))
    one.write(1, KEY, PAYLOAD)
    one.flush()
    size = one.num_bytes
    bounded = DiskTier(tmp_path, "m", 3 * size, len(PAYLOAD))  # started beside it: sees block 1
    for block_hash in (2, 3):
        one.write(block_hash, KEY, PAYLOAD)
    one.flush()
    assert 2 not in bounded  # written after it looked
    bounded.refresh(now=True)
    bounded.flush()
    assert all(h in bounded for h in (1, 2, 3)) and read(bounded, 2) == PAYLOAD
    bounded.write(4, KEY, PAYLOAD)  # one file over its bound: the oldest goes, for both
    bounded.flush()
    assert sorted(p.name for p in one.root.glob("*.kv")) == [f"{h:016x}.kv" for h in (2, 3, 4)]
    one.refresh(now=True)
    one.flush()
    assert [h in one for h in (1, 2, 3, 4)] == [False, True, True, True] and read(one, 4) == PAYLOAD
    assert sorted(one.take_gone()) == [1] and one.stats.corrupt == bounded.stats.corrupt == 0


def test_workers_writing_and_reading_the_same_blocks_at_once_never_read_a_bad_one(tmp_path):
    disks = [DiskTier(tmp_path, "m", 1 << 20, len(PAYLOAD)) for _ in range(2)]
    for round_ in range(30):
        for disk in disks:  # both write the same blocks while the other looks for them and reads them
            for block_hash in range(8):
                disk.write(block_hash + 8 * (round_ % 3), KEY, PAYLOAD)
                disk.refresh(now=True)
                disk.request(block_hash)
    for disk in disks:
        disk.flush()
        assert all(disk.take_ready(h, KEY) in (PAYLOAD, None) for h in range(24))
        disk.refresh(now=True)
        disk.flush()
    assert all(read(disk, h) == PAYLOAD for disk in disks for h in range(24))
    assert [disk.stats.corrupt for disk in disks] == [0, 0]


def test_a_writer_too_far_behind_skips_a_spill_instead_of_queueing_it(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_tier, "WRITE_BACKLOG_BYTES", 2 * len(PAYLOAD))
    disk = DiskTier(tmp_path, "m", 1 << 20, len(PAYLOAD))
    stalled = threading.Event()
    disk._writer.submit(stalled.wait)  # a disk that does not keep up
    for block_hash in (1, 2, 3):
        disk.write(block_hash, KEY, PAYLOAD)
    assert disk.stats.skipped == 1 and disk.take_gone() == [3]
    stalled.set()
    disk.flush()
    assert [h in disk for h in (1, 2, 3)] == [True, True, False] and read(disk, 2) == PAYLOAD
    disk.write(3, KEY, PAYLOAD)  # caught up: written again
    disk.flush()
    assert 3 in disk and disk.stats.skipped == 1


def test_the_byte_bound_evicts_the_oldest_files(tmp_path):
    disk = DiskTier(tmp_path, "m", 1 << 20, len(PAYLOAD))
    disk.write(1, KEY, PAYLOAD)
    disk.flush()
    size = disk.num_bytes
    bounded = DiskTier(tmp_path / "b", "m", 3 * size, len(PAYLOAD))
    for block_hash in range(1, 6):
        bounded.write(block_hash, KEY, PAYLOAD)
    bounded.flush()
    assert [h in bounded for h in range(1, 6)] == [False, False, True, True, True]
    assert sorted(p.name for p in bounded.root.glob("*.kv")) == [f"{h:016x}.kv" for h in (3, 4, 5)]


def test_a_restart_finds_the_blocks_and_ignores_temporary_files(tmp_path):
    disk = DiskTier(tmp_path, "m", 1 << 20, len(PAYLOAD))
    for block_hash in (1, 2):
        disk.write(block_hash, KEY, PAYLOAD)
    disk.close()
    (disk.root / ".0000000000000003.99.1.tmp").write_bytes(b"half a block")
    again = DiskTier(tmp_path, "m", 1 << 20, len(PAYLOAD))
    assert len(again) == 2 and 3 not in again
    assert read(again, 2) == PAYLOAD


WRITER = """
import os, signal, sys
from pagedserve.worker.core.kv_cache.disk_tier import DiskTier

disk = DiskTier(sys.argv[1], "m", 1 << 20, 1024)
for i in (1, 2):
    disk.write(i, (None, (i,), None), bytes(range(256)) * 4)
disk.flush()

def half_then_killed(path, parts):  # the process dies with half of the third block written
    data = b"".join(bytes(part) for part in parts)
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    os.kill(os.getpid(), signal.SIGKILL)

DiskTier._write_parts = staticmethod(half_then_killed)
disk.write(3, (None, (3,), None), bytes(range(256)) * 4)
disk.flush()
"""


def test_a_writer_killed_mid_write_leaves_no_block_that_fails_its_check(tmp_path):
    child = subprocess.run([sys.executable, "-c", WRITER, str(tmp_path)], timeout=60)
    assert child.returncode == -signal.SIGKILL, "the writer was meant to die inside its third write"
    disk = DiskTier(tmp_path, "m", 1 << 20, 1024)
    assert sorted(int(p.stem, 16) for p in disk.root.glob("*.kv")) == [1, 2]
    for block_hash in (1, 2, 3):
        expected = bytes(range(256)) * 4 if block_hash < 3 else None
        assert (read(disk, block_hash, (None, (block_hash,), None)) if block_hash in disk else None) == expected
    assert disk.stats.corrupt == 0
