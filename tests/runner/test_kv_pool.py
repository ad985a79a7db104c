"""The host pool's pages: zeros, resident only once written (``worker/runner/kv_pool.zeroed_pool``)."""

from __future__ import annotations

import re

import torch

from pagedserve.worker.runner.kv_cache.pool import zeroed_pool

def resident_mib() -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024


def test_a_host_pool_reads_zeros_and_takes_memory_only_where_written():
    before = resident_mib()
    pool = zeroed_pool((2, 1024, 16, 8, 256), torch.float32, "cpu")  # 256 MiB, blocks of 128 KiB
    assert pool.shape == (2, 1024, 16, 8, 256) and pool.dtype == torch.float32 and pool.is_contiguous()
    assert resident_mib() - before < 16  # none of it is resident yet
    assert not pool[0, 7].any() and not pool[1, 1023].any()  # reading maps the shared zero page
    pool[0, :8] = 1.5  # 8 blocks: 1 MiB written
    assert resident_mib() - before < 16
    assert pool[0, :8].eq(1.5).all() and not pool[0, 8:].any()
    pool.view(-1)[:] = 2.0
    assert resident_mib() - before > 200  # written: resident


def test_device_and_empty_pools_are_plain_zeros():
    assert zeroed_pool((0, 4), torch.bfloat16, "cpu").shape == (0, 4)
    meta = zeroed_pool((3, 4), torch.float16, "meta")
    assert meta.device.type == "meta" and meta.dtype == torch.float16
