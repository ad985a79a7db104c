"""The ranks of one worker as a torch.distributed process group (gloo on the CPU, NCCL on CUDA),
held as an object rather than torch's default group, so an engine can start, close and start again
in one process. Every collective the model and the step plan need, and nothing else: a sum across
ranks (the row-parallel layers), a gather along the last dimension (the vocabulary-parallel head),
a broadcast of one Python object from rank 0 (the step's command) and a minimum (the pool size).

A collective that fails because a peer is gone raises ``RankFailure``: a ``DeviceFailure``, so the
worker ends and is restarted, as after a broken device.
"""

from __future__ import annotations

import datetime
import pickle
import time
from typing import Any

import torch
from torch import distributed as dist

from pagedserve.worker.runner.device.failures import DeviceFailure

TIMEOUT = datetime.timedelta(minutes=10)  # the longest a rank waits for the others (a model load)


class RankFailure(DeviceFailure):
    """A collective failed: another rank of the worker is gone."""


class RankGroup:
    def __init__(self, rank: int, size: int, store: dist.Store, device: torch.device) -> None:
        """Join the group whose ranks meet at ``store`` (every rank blocks here until all have)."""
        self.rank, self.size, self.device, self.store = rank, size, device, store
        self.seconds: dict[str, float] = dict.fromkeys(("all_reduce", "all_gather", "broadcast", "min"), 0.0)  # waited in each
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = TIMEOUT  # the constructor takes its options positionally, the timeout in them
            self.group = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, size, TIMEOUT)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks, in place (returned)."""
        self._run("all_reduce", lambda: self.group.allreduce([x]))
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` side by side along the last dimension (every rank gets the whole)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._run("all_gather", lambda: self.group.allgather([parts], [x]))
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' ``value``."""
        x = torch.tensor([value], dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self._run("min", lambda: self.group.allreduce([x], options))
        return int(x.item())

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled: step plans and commands are plain dataclasses)."""
        payload = pickle.dumps(obj) if self.rank == 0 else b""
        length = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        self._run("broadcast", lambda: self.group.broadcast(length, 0))
        data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == 0
                else torch.empty(int(length.item()), dtype=torch.uint8))
        data = data.to(self.device)
        self._run("broadcast", lambda: self.group.broadcast(data, 0))
        return obj if self.rank == 0 else pickle.loads(data.cpu().numpy().tobytes())

    def _run(self, kind: str, issue) -> None:
        """Issue a collective and wait for it (its time counted under ``kind``: ``bench/tensor_parallel.py``)."""
        started = time.perf_counter()
        try:
            issue().wait()
            self.seconds[kind] += time.perf_counter() - started
        except RuntimeError as err:
            raise RankFailure(f"rank {self.rank} of {self.size}: a collective failed (another rank is gone?): {err}") from err
