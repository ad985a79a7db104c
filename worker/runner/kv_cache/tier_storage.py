"""The bytes of the tiers under the device pool (the bookkeeping: ``worker/core/kv_cache/tiers.py``): a
host pool laid out as the device pool (pinned on CUDA, so copies up are asynchronous), and the
copies of a step's ``TierMoves`` in two halves around the swap-outs.

A block's bytes on disk are its slice of the pool, every layer's K and V (and a quantized row's
scale) in the pool's storage dtype, so a load is one copy into the device block.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch

from pagedserve.kernels import reference
from pagedserve.worker.core.kv_cache.disk_tier import DiskTier
from pagedserve.worker.core.kv_cache.tiers import TierMoves
from pagedserve.worker.runner.kv_cache.pool import zeroed_pool


class TierCopier:
    def __init__(self, kv_pool: torch.Tensor, num_host_slots: int, disk: DiskTier | None) -> None:
        self.kv_pool, self.disk = kv_pool, disk
        pinned = kv_pool.device.type == "cuda" and num_host_slots > 0
        self.host_pool = zeroed_pool((kv_pool.shape[0], num_host_slots, *kv_pool.shape[2:]), kv_pool.dtype, "cpu",
                                     pinned=pinned)
        self.copy_up_seconds = 0.0  # spent copying blocks up (on CUDA: queueing the copies)

    @staticmethod
    def payload_bytes(kv_pool: torch.Tensor) -> int:
        """Bytes of one block's slice of ``kv_pool``: what a disk file carries."""
        return kv_pool[:, 0].numel() * kv_pool.element_size()

    def before_swaps(self, moves: TierMoves) -> None:
        """Spills to disk, then demotions into the host pool: every read of a slot or block this
        step's other moves or forward may overwrite."""
        self.spill(moves.spills)
        if moves.demotions:
            reference.swap_blocks(self.kv_pool, self.host_pool, reference.block_pairs(moves.demotions, self.kv_pool.device))

    def spill(self, spills, wait: bool = False) -> None:
        """Hand these blocks' bytes to the disk tier (``wait``: for its writer, rather than skip)."""
        for source, index, block_hash, key in spills:
            pool = self.host_pool if source == "host" else self.kv_pool
            data = pool[:, index].to("cpu", copy=True, memory_format=torch.contiguous_format)
            self.disk.write(block_hash, key, data.view(torch.uint8).numpy(), wait)  # a copy of its own: the slot may be reused

    def after_swap_out(self, moves: TierMoves) -> None:
        """Promotions from the host pool and loads from disk, into device blocks a swap-out may
        have just freed."""
        if not (moves.promotions or moves.loads):
            return
        started = time.perf_counter()
        if moves.promotions:
            reference.swap_blocks(self.host_pool, self.kv_pool, reference.block_pairs(moves.promotions, self.host_pool.device))
        shape, dtype = self.kv_pool[:, 0].shape, self.kv_pool.dtype
        for payload, block in moves.loads:
            with warnings.catch_warnings():  # read-only bytes: only read here
                warnings.simplefilter("ignore", UserWarning)
                data = torch.frombuffer(payload, dtype=torch.uint8)
            self.kv_pool[:, block].copy_(data.view(dtype).view(shape))
        self.copy_up_seconds += time.perf_counter() - started


def tier_fingerprint(model_dir: Path, kv_pool: torch.Tensor, **settings) -> str:
    """What a disk-tier block's bytes depend on besides its tokens: the model's files (names and
    sizes), the pool's block layout and storage dtype, and ``settings`` (dtype, cache format,
    weight quantization)."""
    files = sorted((p.name, p.stat().st_size) for p in Path(model_dir).iterdir() if p.is_file())
    layout = (tuple(kv_pool.shape[:1]) + tuple(kv_pool.shape[2:]), str(kv_pool.dtype))
    return repr((str(Path(model_dir).resolve()), files, layout, sorted(settings.items())))
