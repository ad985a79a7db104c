"""The torch reference of decode attention with quantized products
(``paged_kernels/quantized_products.py``): the same roundings in the same places, so the Triton
kernel is checked against it (equal up to the order of float32 sums) and the CPU can measure what
the roundings cost on real weights (``--attention-backend torch --quantized-products``;
docs/engine.md).

Queries are quantized to the cache's codes per query head (over the row's largest magnitude, times
the largest code: int8's 127, e4m3's 448); the scores are the codes' products times the query's and
each key row's scale; the probabilities, each times its value row's scale, are quantized per query
head and key tile (tiles of ``decode_tile`` positions from position 0, the kernel's), over the
tile's largest, before their product with the value codes. The softmax's sum is taken before that
rounding, as the kernel's is.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from pagedserve.kernels.decode_partitions import decode_tile
from pagedserve.kernels.kv_format import KVFormat

FLOOR = 2.0 ** -100  # a factor at least this: its reciprocal stays finite (zeros' codes are zeros)


def to_codes(x: torch.Tensor, kv_format: KVFormat) -> torch.Tensor:
    """float32 ``x`` rounded to the values of ``kv_format``'s codes (nearest, ties to even, saturated
    at the largest code), as float32."""
    largest = kv_format.largest
    if kv_format.code == torch.int8:
        return x.round().clamp(-largest, largest)
    return x.clamp(-largest, largest).to(kv_format.code).float()


def row_codes(x: torch.Tensor, kv_format: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` over its last dimension's largest magnitude times the largest code, as code values, and
    the factor ``largest / largest code`` that scales a product of them back (``[..., 1]``)."""
    back = x.abs().amax(-1, keepdim=True) / kv_format.largest
    return to_codes(x * (1.0 / back.clamp_min(FLOOR)), kv_format), back


def decode_products(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, allowed: torch.Tensor, scale: float,
                    softcap: float, kv_format: KVFormat) -> torch.Tensor:
    """q ``[S, Hq, D]``; ``k_rows``/``v_rows``: the gathered uint8 rows ``[S, L, Hkv, row_width]``;
    ``allowed`` ``[S, L]`` -> float32 ``[S, Hq, D]``."""
    seqs, length, kv_heads, _ = k_rows.shape
    dim = q.shape[-1]
    group = q.shape[1] // kv_heads
    k_codes, k_scale = (t.transpose(1, 2) for t in kv_format.codes(k_rows))  # [S, Hkv, L, D], [S, Hkv, L, 1]
    v_codes, v_scale = (t.transpose(1, 2) for t in kv_format.codes(v_rows))
    q_codes, q_back = row_codes(q.float().view(seqs, kv_heads, group, dim), kv_format)
    scores = torch.matmul(q_codes, k_codes.transpose(-1, -2)) * q_back * (k_scale * scale).transpose(-1, -2)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))  # [S, Hkv, group, L]
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    tile = decode_tile(dim, quantized_products=True)
    pad = -length % tile
    weights = F.pad(p * v_scale.transpose(-1, -2), (0, pad)).view(seqs, kv_heads, group, -1, tile)
    w_codes, w_back = row_codes(weights, kv_format)  # [S, Hkv, group, tiles, tile], [..., tiles, 1]
    v_tiles = F.pad(v_codes, (0, 0, 0, pad)).view(seqs, kv_heads, 1, -1, tile, dim)
    weighted = (torch.matmul(w_codes.unsqueeze(-2), v_tiles).squeeze(-2) * w_back).sum(-2)  # [S, Hkv, group, D]
    return (weighted / p.sum(-1, keepdim=True)).reshape(seqs, kv_heads * group, dim)
