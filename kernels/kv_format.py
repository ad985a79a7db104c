"""How K/V are stored in the paged cache: at the model's dtype (``auto``), or one byte per element
(``int8``, ``fp8_e4m3``, ``fp8_e5m2``; ``fp8`` is ``fp8_e4m3``, as vLLM names them).

A quantized cache keeps, for every (position, KV head), its ``head_dim`` one-byte codes and then
the row's scale as a bfloat16 (2 bytes; float32's range, so no row's scale underflows, and as
values are divided by the stored scale its rounding costs nothing): rows of ``head_dim + 2`` bytes
in a ``uint8`` cache of shape ``[num_blocks, block_size, num_kv_heads, head_dim + 2]``. The scale lives beside its values,
so everything that moves whole blocks (copy-on-write, swap, the prefix cache, sliding-window
release) carries it without knowing it is there, and a block's bytes are simply its tensor's.
Scales are per token and head (absmax / the format's largest value), set once when the token is
stored: no calibration, no requantization when a block fills up. Codes are decoded through a
256-entry table (the C kernel uses the same one for fp8; int8 it converts arithmetically).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagedserve.kernels.backends import KV_CACHE_DTYPES

SCALE_BYTES = 2  # a bfloat16 scale at the end of every row


@dataclass(frozen=True)
class KVFormat:
    name: str
    code: torch.dtype | None = None  # the element type of the one-byte codes; None: not quantized
    largest: float = 0.0  # the largest magnitude a code holds

    @property
    def quantized(self) -> bool:
        return self.code is not None

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.uint8 if self.quantized else model_dtype

    def row_width(self, head_dim: int) -> int:
        """Elements of the cache's last dimension for one (position, KV head)."""
        return head_dim + SCALE_BYTES if self.quantized else head_dim

    def head_dim(self, cache: torch.Tensor) -> int:
        return cache.shape[-1] - SCALE_BYTES if self.quantized else cache.shape[-1]

    def bytes_per_element(self, model_dtype: torch.dtype) -> int:
        return 1 if self.quantized else torch.empty((), dtype=model_dtype, device="meta").element_size()

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., head_dim]`` values -> ``[..., head_dim + 2]`` uint8 rows (codes, then the scale)."""
        xf = x.float()
        scale = (xf.abs().amax(dim=-1, keepdim=True) / self.largest).to(torch.bfloat16).float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale
        scaled = xf / scale
        if self.code == torch.int8:
            codes = scaled.round().clamp(-127, 127).to(torch.int8)
        else:
            codes = scaled.clamp(-self.largest, self.largest).to(self.code)
        scale_bytes = scale.to(torch.bfloat16).view(torch.uint8)
        return torch.cat([codes.view(torch.uint8), scale_bytes], dim=-1)

    def dequantize(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[..., head_dim + 2]`` uint8 rows -> float32 ``[..., head_dim]`` (into ``out`` if given)."""
        dim = rows.shape[-1] - SCALE_BYTES
        scale = rows[..., dim:].contiguous().view(torch.bfloat16).float()
        values = self.table(rows.device)[rows[..., :dim].long()]
        return torch.mul(values, scale, out=out) if out is not None else values * scale

    def table(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """float32 ``[256]``: the value of every code byte (made once per format, not per call)."""
        return _code_table(self.code).to(device)


@functools.lru_cache(maxsize=None)
def _code_table(code: torch.dtype) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(code).float()


FORMATS = {
    "auto": KVFormat("auto"),
    "int8": KVFormat("int8", torch.int8, 127.0),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 57344.0),
}
FORMATS["fp8"] = FORMATS["fp8_e4m3"]
AUTO = FORMATS["auto"]


def kv_format(name: str) -> KVFormat:
    if name not in FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}")
    return FORMATS[name]
