"""Failures of the accelerator itself, told apart from a failed step.

After an illegal address, a device-side assert or a failed launch a CUDA context is broken for
good: every later step fails too. Such an error must end the worker (its supervisor restarts it
and its streams resume on another worker, as after a crash) instead of failing requests forever.
Out of memory is not one: the requests of that step fail and the engine goes on.
"""

from __future__ import annotations

import contextlib

import torch

STICKY = ("CUDA error", "illegal memory access", "device-side assert", "unspecified launch failure",
          "illegal instruction", "CUBLAS_STATUS", "CUDNN_STATUS", "misaligned address")


class DeviceFailure(RuntimeError):
    """The device is in an error state no later step can leave: the process must restart."""


def is_device_failure(err: BaseException) -> bool:
    if isinstance(err, torch.OutOfMemoryError):
        return False
    if isinstance(err, DeviceFailure):  # a tensor-parallel rank gone (worker/runner/parallel/group.py)
        return True
    if type(err).__name__ == "AcceleratorError":  # torch's own type for CUDA errors
        return True
    return isinstance(err, RuntimeError) and any(marker in str(err) for marker in STICKY)


def device_guard(device: torch.device):
    """Make ``device`` the current CUDA device for the block (Triton launches and graph capture use
    the current one, not the tensors'); nothing elsewhere."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
