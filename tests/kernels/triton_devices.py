"""Where the Triton kernel tests run: on CUDA (``gpu`` marker) when a device is present, else under
TRITON_INTERPRET=1 on the CPU. Import it before any kernel: the interpreter is chosen when a kernel
is decorated."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICES = [
    pytest.param("cpu", id="interpreter", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="runs on the GPU instead")),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]),
]
