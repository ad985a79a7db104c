"""A tensor-parallel rank other than 0: ``python -m pagedserve.worker.setup.follower RANK SIZE
HOST PORT DEVICE``, started by rank 0 (``ranks.py``). It joins the group, takes the engine's config,
loads its slice of the model and then does what rank 0 announces, one call at a time: the calls
that build the runner (``RunnerBuild``'s), the host KV tier, the decode kernels' warm-up, LoRA
adapters loaded and unloaded, each step's forward, stop.
It never samples and holds no scheduler: its KV blocks are rank 0's block ids, its slice of them.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import structlog
import torch
from torch import distributed as dist

from pagedserve.worker.core.scheduling.plan import StepPlan
from pagedserve.worker.runner.device.failures import device_guard
from pagedserve.worker.runner.kv_cache.tier_storage import TierCopier
from pagedserve.worker.runner.loader import inspect_model
from pagedserve.worker.runner.model_runner import ModelRunner
from pagedserve.worker.runner.parallel.group import TIMEOUT, RankFailure, RankGroup
from pagedserve.worker.setup.ranks import rank_threads
from pagedserve.worker.setup.runner_build import RunnerBuild

log = structlog.get_logger("pagedserve.parallel")

PARENT_POLL_S = 0.5


class Follower:
    def __init__(self, build: RunnerBuild) -> None:
        self.build = build
        self.runner: ModelRunner | None = None

    def load_adapters(self) -> None:
        self.build.load_adapters()

    def load_adapter(self, name: str, path: str) -> None:
        self.build.adapters.load(name, path)  # rank 0 read it first: a failure here (the files changed) ends this rank

    def unload_adapter(self, name: str) -> None:
        self.build.adapters.unload(name)

    def calibrate(self, ids: list[int]) -> None:
        self.build.calibrate(ids)

    def pool_blocks(self, max_len: int, graphs: bool) -> int:
        return self.build.pool_blocks(max_len, graphs)

    def make_runner(self, *args) -> None:
        self.runner = None  # the old pool goes before the new one is allocated
        self.runner = self.build.make_runner(*args)

    def host_tier(self, num_host: int) -> None:
        """The host tier's slots for this rank's part of each block (the disk tier is refused under TP)."""
        self.runner.tiers = TierCopier(self.runner.kv_pool, num_host, None)

    def warm_decode(self, max_len: int) -> None:
        self.runner.warm_decode(max_len)

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> None:
        self.runner.forward(plan)


def serve(group: RankGroup) -> None:
    """Take the config, build, then follow rank 0's calls until it says stop."""
    config = group.broadcast()
    with device_guard(group.device):
        follower = Follower(RunnerBuild(config, inspect_model(config.model, config.dtype), group.device, group=group))
        while True:
            name, args = group.broadcast()
            if name == "stop":
                return
            getattr(follower, name)(*args)


def main(argv: list[str]) -> int:
    rank, size, host, port, device = int(argv[0]), int(argv[1]), argv[2], int(argv[3]), torch.device(argv[4])
    threading.Thread(target=_end_with_parent, args=(os.getppid(),), name="parent-watch", daemon=True).start()
    if device.type == "cpu":
        torch.set_num_threads(rank_threads(size))
    else:
        torch.cuda.set_device(device)  # before NCCL makes its communicator: it binds to the current device
    group = RankGroup(rank, size, dist.TCPStore(host, port, size, False, timeout=TIMEOUT), device)
    try:
        serve(group)
    except RankFailure as err:
        log.error("tensor parallel rank 0 is gone: this rank ends", rank=rank, error=str(err))
        return 1
    return 0


def _end_with_parent(parent: int) -> None:
    """Exit as soon as rank 0 is gone, even while this rank loads or computes (a killed rank 0 runs
    no cleanup, and a rank with no collective pending would not notice): this process is handed to
    another parent then."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    log.error("tensor parallel rank 0 exited: this rank ends", parent=parent)
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
