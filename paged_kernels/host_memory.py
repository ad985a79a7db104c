"""Host memory for what the CPU kernels stream every step (weights in their kernels' layouts, a GGUF
file's blocks): allocated by numpy, which asks Linux for transparent huge pages for large arrays
(``madvise(MADV_HUGEPAGE)``; honoured where THP is ``always`` or ``madvise``). Streamed from 2 MiB
pages, the weights read faster than from torch's 4 KiB ones or the page cache's: the 1.5B Q4_K_M's
196 layer matrices at one row 51 -> 39 ms, its Q6_K head 11.2 -> 7.8 ms (2-core Xeon, 2026-12-06).
"""

from __future__ import annotations

import math

import numpy as np
import torch


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor of ``shape`` and ``dtype`` in memory numpy allocated."""
    count = math.prod(shape)
    raw = np.empty(count * torch.empty((), dtype=dtype).element_size(), dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


def huge_page_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``tensor`` (any strides) in memory numpy allocated."""
    return huge_page_empty(tuple(tensor.shape), tensor.dtype).copy_(tensor)
