"""Rank 0's side of tensor parallelism: the other ranks started as processes of their own
(``python -m pagedserve.worker.setup.follower``), joined into one group, told the engine's
config, then each call that runs on every rank (``mirror``) and each step's plan (``announce_step``).

Supervision: a thread waits on every follower; one that exits while the engine runs is logged and
recorded (``lost``), and the collective rank 0 is in or next enters fails (``RankFailure``, a
``DeviceFailure``), so the worker ends and is restarted as after a broken device. Followers end when
rank 0 does: told to stop (``close``), by the group failing, or, if rank 0 is killed, by
seeing their parent change.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from typing import Any

import structlog
import torch
from torch import distributed as dist

from pagedserve.worker.core.scheduling.plan import StepPlan
from pagedserve.worker.runner.parallel.group import TIMEOUT, RankGroup
from pagedserve.worker.setup.engine_config import EngineConfig

log = structlog.get_logger("pagedserve.parallel")

HOST = "127.0.0.1"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the next GPU after rank 0's on CUDA, the CPU on the CPU."""
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


def rank_threads(size: int) -> int:
    """A rank's compute threads on the CPU: the cores shared between the ranks."""
    return max(1, (os.cpu_count() or 1) // size)


def follower_plan(plan: StepPlan) -> StepPlan:
    """What another rank needs of a step's plan: its forward's inputs (no grammar state, no
    token history for penalties: only rank 0 samples; no draft context: only rank 0 holds the
    draft model, and the plan comes with its drafts in)."""
    seqs = tuple(replace(s, grammar=None, draft_grammars=(), prompt_ids=(), output_ids=(), draft_context=None)
                 for s in plan.seqs)
    return replace(plan, seqs=seqs)


class Ranks:
    def __init__(self, group: RankGroup, processes: list[subprocess.Popen]) -> None:
        self.group, self.processes = group, processes
        self.lost: str | None = None  # why a follower ended while the engine ran
        self.closing = False
        for rank, process in enumerate(processes, start=1):
            threading.Thread(target=self._watch, args=(rank, process), name=f"tp-rank-{rank}", daemon=True).start()

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> Ranks:
        size = config.tensor_parallel_size
        if device.type == "cuda" and torch.cuda.device_count() < (device.index or 0) + size:
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs from {device}; "
                             f"this machine has {torch.cuda.device_count()}")
        if device.type == "cpu":
            torch.set_num_threads(rank_threads(size))
        store = dist.TCPStore(HOST, 0, size, True, timeout=TIMEOUT, wait_for_workers=False)
        processes = [subprocess.Popen([sys.executable, "-m", "pagedserve.worker.setup.follower", str(rank),
                                       str(size), HOST, str(store.port), str(rank_device(device, rank))])
                     for rank in range(1, size)]
        try:
            group = RankGroup(0, size, store, device)
            group.broadcast(config)
        except BaseException:
            for process in processes:
                process.kill()
            raise
        log.info("tensor parallel ranks joined", size=size, backend="nccl" if device.type == "cuda" else "gloo",
                 pids=[p.pid for p in processes])
        return cls(group, processes)

    def announce(self, name: str, *args: Any) -> None:
        """Have every follower call ``name(*args)`` (``follower.Follower``'s methods)."""
        self.group.broadcast((name, args))

    def announce_step(self, plan: StepPlan) -> None:
        self.announce("step", follower_plan(plan))

    def mirror(self, target: object) -> object:
        """``target`` whose method calls are first announced to the followers under the same name."""
        return _Mirrored(self, target)

    def explain(self, err: Exception, wait: float = 2.0) -> str:
        """Why a collective failed: which follower exited and how (waiting up to ``wait`` seconds
        for its exit to be seen), else the error itself."""
        deadline = time.monotonic() + wait
        while self.lost is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.lost or str(err)

    def close(self, timeout: float = 30.0) -> None:
        """Tell the followers to stop and wait for them (killed after ``timeout`` seconds)."""
        if self.closing:
            return
        self.closing = True
        if self.lost is None:
            try:
                self.announce("stop")
            except Exception as err:  # a follower already gone: the kill below
                log.warning("tensor parallel ranks: stop not delivered", error=str(err))
        for process in self.processes:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _watch(self, rank: int, process: subprocess.Popen) -> None:
        code = process.wait()
        if not self.closing:
            self.lost = f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {code}"
            log.error("tensor parallel rank lost: the worker stops", rank=rank, pid=process.pid, code=code)


class _Mirrored:
    def __init__(self, ranks: Ranks, target: object) -> None:
        self._ranks, self._target = ranks, target

    def __getattr__(self, name: str):
        method = getattr(self._target, name)

        def call(*args):
            self._ranks.announce(name, *args)
            return method(*args)

        return call
