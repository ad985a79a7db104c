"""Copies between the host and the device that never wait for the device's queued work.

A step's inputs go up with ``device_tensor`` (a plain ``torch.tensor(values, device=cuda)`` waits
for everything queued on the stream first, so a step planned while the previous one runs would
wait for it); its sampled tokens come down with ``HostCopy`` (queued after the step, read once an
event says they are there), so the host reads step N while the device runs step N+1
(``worker/core/scheduling/run_ahead.py``). On the CPU both are plain copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def device_tensor(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` (a list) as a tensor on ``device``, copied up without a wait for the device."""
    host = torch.tensor(values, dtype=dtype, device="cpu")
    return host if torch.device(device).type == "cpu" else host.to(device, non_blocking=True)


@dataclass(frozen=True)
class HostCopy:
    """Device tensors' copies on the host, queued behind the work that makes them."""

    tensors: tuple[torch.Tensor, ...]  # on the host (pinned, on CUDA)
    ready: torch.cuda.Event | None  # recorded after the copies; None: already there (the CPU)

    @classmethod
    def queue(cls, *tensors: torch.Tensor) -> HostCopy:
        if all(t.device.type == "cpu" for t in tensors):
            return cls(tensors, None)
        copies = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors)
        ready = torch.cuda.Event()
        ready.record()
        return cls(copies, ready)

    def read(self) -> tuple[torch.Tensor, ...]:
        """The host copies, once they are there (waits for the work before them, not after)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.tensors
