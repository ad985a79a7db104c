"""How K/V are stored in the paged cache: at the model's dtype (``auto``), or one byte per element
(``int8``, ``fp8_e4m3``, ``fp8_e5m2``; ``fp8`` is ``fp8_e4m3``, as vLLM names them).

A quantized cache keeps, for every (position, KV head), its ``head_dim`` one-byte codes and then
the row's scale as a bfloat16 (2 bytes; float32's range, so no row's scale underflows, and as
values are divided by the stored scale its rounding costs nothing): rows of ``head_dim + 2`` bytes
in a ``uint8`` cache of shape ``[num_blocks, block_size, num_kv_heads, head_dim + 2]``. On CUDA the rows
end in 16 bytes instead (the scale, then 14 unused; ``aligned``): a row of a head of 128 is 144
bytes, a multiple of 16, so the kernels read a tile's codes in 16-byte loads and copy them into
shared memory asynchronously, as they do a 16-bit cache's; rows of 130 bytes are read a byte at a
time (sm_90 machine code: 1,949 instructions a decode tile against 704 aligned; docs/benchmarks.md).
The CPU keeps the tight rows (its kernels read bytes either way). The scale lives beside its values,
so everything that moves whole blocks (copy-on-write, swap, the prefix cache, sliding-window
release) carries it without knowing it is there, and a block's bytes are simply its tensor's.
Scales are per token and head (absmax / the format's largest value), set once when the token is
stored: no calibration, no requantization when a block fills up. Codes are decoded through a
256-entry table (the C kernel uses the same one for fp8; int8 it converts arithmetically).
With ``quantized_products`` (int8 and fp8_e4m3) the decode kernels skip that decoding and multiply
the codes themselves (``paged_kernels/quantized_products.py``); the bytes stored are the same.

Before a quantized cache stores its keys, q and k are turned by one fixed orthogonal matrix
(``rotation``): scores are unchanged (q R . k R = q . k), and the few channels where keys carry
most of their magnitude (the low-frequency rotary pairs) are spread over all of them, so a row's
absmax no longer sets a step far coarser than most of its values need. An engine then fits, per
layer and KV head, a stretch before that turn from the model's own queries and keys on a shipped
text (``worker/runner/attention/key_rotation.py``), still exact for the scores. An int8 cache turns the
values too and the attention output back ((sum p v R) R^T): its evenly spaced steps gain from it,
fp8's steps, relative to each value, lose. Measured on the default model in docs/engine.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from pagedserve.kernels.backends import KV_CACHE_DTYPES, PRODUCT_CACHE_DTYPES

SCALE_BYTES = 2  # a bfloat16 scale after every row's codes
ALIGNED_TAIL = 16  # on CUDA: the scale and 14 unused bytes, so rows of a head a multiple of 16 stay 16-byte aligned


@dataclass(frozen=True)
class KVFormat:
    name: str
    code: torch.dtype | None = None  # the element type of the one-byte codes; None: not quantized
    largest: float = 0.0  # the largest magnitude a code holds
    rotation_values: bool = False  # values turned too (evenly spaced codes gain; fp8's relative steps lose)
    tail: int = SCALE_BYTES  # bytes of a quantized row after its codes: the scale, then padding (``aligned``)
    quantized_products: bool = False  # decode attention multiplies the codes as stored (paged_kernels/quantized_products.py)

    @property
    def quantized(self) -> bool:
        return self.code is not None

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.uint8 if self.quantized else model_dtype

    def aligned(self) -> KVFormat:
        """This format with rows ending in ``ALIGNED_TAIL`` bytes (the module's docstring): CUDA's."""
        return replace(self, tail=ALIGNED_TAIL) if self.quantized else self

    def row_width(self, head_dim: int) -> int:
        """Elements of the cache's last dimension for one (position, KV head)."""
        return head_dim + self.tail if self.quantized else head_dim

    def head_dim(self, cache: torch.Tensor) -> int:
        return cache.shape[-1] - self.tail if self.quantized else cache.shape[-1]

    def bytes_per_element(self, model_dtype: torch.dtype) -> int:
        return 1 if self.quantized else torch.empty((), dtype=model_dtype, device="meta").element_size()

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., head_dim]`` values -> ``[..., row_width(head_dim)]`` uint8 rows (codes, the scale, zeros)."""
        xf = x.float()
        # An all-zero row gets the least normal scale (its codes are zeros whatever the scale).
        scale = (xf.abs().amax(dim=-1, keepdim=True) / self.largest).clamp_min_(2**-126).to(torch.bfloat16)
        scaled = xf / scale.float()
        if self.code == torch.int8:
            codes = scaled.round().clamp(-127, 127).to(torch.int8)
        else:
            codes = scaled.clamp(-self.largest, self.largest).to(self.code)
        pad = codes.new_zeros((*codes.shape[:-1], self.tail - SCALE_BYTES), dtype=torch.uint8)
        return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8), pad], dim=-1)

    def quantize_pair(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``quantize`` of K and V in one pass (half the small ops of two: it runs in every layer)."""
        rows = self.quantize(torch.stack((key, value)))
        return rows[0], rows[1]

    def dequantize(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[..., row_width]`` uint8 rows -> float32 ``[..., head_dim]`` (into ``out`` if given)."""
        values, scale = self.codes(rows)
        return torch.mul(values, scale, out=out) if out is not None else values * scale

    def codes(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[..., row_width]`` uint8 rows -> the codes' float32 values ``[..., head_dim]`` and each
        row's float32 scale ``[..., 1]``."""
        dim = rows.shape[-1] - self.tail
        scale = rows[..., dim : dim + SCALE_BYTES].contiguous().view(torch.bfloat16).float()
        return self.table(rows.device)[rows[..., :dim].long()], scale

    def rotation(self, head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """float32 ``[head_dim, head_dim]``, orthogonal: what q and k (and v where
        ``rotation_values``; the output then by its transpose) are multiplied by before a quantized cache
        stores them (None at the model's dtype). The same on every machine (seeded,
        made on the CPU), so the same tokens still give the same blocks."""
        return _rotation(head_dim, torch.device(device)) if self.quantized else None

    def table(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """float32 ``[256]``: the value of every code byte (made once per format, not per call)."""
        return _code_table(self.code).to(device)


@functools.lru_cache(maxsize=None)
def _code_table(code: torch.dtype) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32, device="cpu").to(torch.uint8).view(code).float()


@functools.lru_cache(maxsize=None)
def _rotation(head_dim: int, device: torch.device) -> torch.Tensor:
    """A Hadamard matrix with seeded random column signs where ``head_dim`` is a power of two (every
    entry +-1/sqrt(head_dim): no channel can keep its magnitude), a seeded random orthogonal one
    (Gaussian, QR) elsewhere."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    if head_dim & (head_dim - 1):
        return torch.linalg.qr(torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64, device="cpu"))[0].float().to(device)
    hadamard = torch.ones(1, 1, device="cpu")
    while hadamard.shape[0] < head_dim:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)])
    signs = torch.randint(0, 2, (head_dim,), generator=generator, device="cpu").float() * 2 - 1
    return (hadamard * signs / head_dim ** 0.5).to(device)


FORMATS = {
    "auto": KVFormat("auto"),
    "int8": KVFormat("int8", torch.int8, 127.0, rotation_values=True),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 57344.0),
}
FORMATS["fp8"] = FORMATS["fp8_e4m3"]
AUTO = FORMATS["auto"]


def kv_format(name: str, device: torch.device | str = "cpu", quantized_products: bool = False) -> KVFormat:
    """The format named ``name`` as a cache on ``device`` keeps it (aligned rows on CUDA);
    ``quantized_products``: its decode attention takes its products on the codes (int8 and fp8_e4m3)."""
    if name not in FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}")
    if quantized_products and name not in PRODUCT_CACHE_DTYPES:
        raise ValueError(f"quantized products multiply an int8 or fp8_e4m3 cache's codes (kv_cache_dtype int8, fp8 or "
                         f"fp8_e4m3); got {name!r}")
    chosen = replace(FORMATS[name], quantized_products=True) if quantized_products else FORMATS[name]
    return chosen.aligned() if torch.device(device).type == "cuda" else chosen
