"""Paged attention of one layer: ``PagedAttention`` stores the step's K/V into the cache slots and
attends through block tables, with whichever ops ``kernels.ops.select_ops`` chose.

The batch is ordered decodes first (one token each), then prefill chunks; ``AttentionMetadata``
describes both parts and is passed explicitly into every layer (no global forward context).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.ops import AttentionOps
from pagedserve.worker.runner.attention.key_rotation import KeyRotation, RotationStats


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    num_decodes: int  # the first num_decodes tokens are single-token decodes, one per sequence
    decode_block_tables: torch.Tensor  # int32 [num_decodes, max_blocks]
    decode_seq_lens: torch.Tensor  # int32 [num_decodes]
    prefill_block_tables: torch.Tensor  # int32 [num_prefills, max_blocks]
    prefill_seq_lens: torch.Tensor  # int32 [num_prefills], context including the chunk
    prefill_query_start: torch.Tensor  # int32 [num_prefills + 1], offsets relative to the prefill part
    # Maxima known on the host when the metadata is built, so no kernel launcher syncs to read them.
    decode_max_seq_len: int = 0
    prefill_max_query_len: int = 0
    prefill_max_seq_len: int = 0
    # int32 [num_tokens]: each token's sequence length (tokens known, computed or not), for the
    # rotary variants that change with it (dynamic NTK, long-rope); None where the model has none.
    token_seq_lens: torch.Tensor | None = None
    # The lanes after the first (worker/core/kv_cache/kv_layout.py): each its own slots and tables, the rest alike.
    other_lanes: tuple[AttentionMetadata, ...] = ()

    def lane(self, index: int) -> AttentionMetadata:
        """The metadata the layers of lane ``index`` read."""
        return self if index == 0 else self.other_lanes[index - 1]


class PagedAttention:
    """Attention of one layer over its paged K/V cache; ``window`` > 0: sliding-window attention
    (each token sees its last ``window`` positions), as the layer's config says; ``softcap`` > 0:
    scores capped as ``softcap * tanh(score / softcap)``."""

    def __init__(self, ops: AttentionOps, scale: float, window: int = 0, softcap: float = 0.0) -> None:
        self.ops = ops
        self.scale = scale
        # Plain attention calls the ops as it always did; a window or a score cap (Gemma 2) is asked for by name.
        self.extra = {**({"window": window} if window > 0 else {}), **({"softcap": softcap} if softcap > 0 else {})}
        # A quantized cache's calibrated turns of q and k (worker/runner/attention/key_rotation.py), set once at
        # start like weights; until then (the calibration's own first pass), the format's fixed turn.
        self.key_rotation: KeyRotation | None = None
        self.observer: RotationStats | None = None  # set only while the calibration text runs

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]``."""
        rotation = self.ops.kv_format.rotation(q.shape[-1], q.device)  # None unless the cache is quantized
        if rotation is None:
            return self._attend(q, k, v, kv_cache, meta)
        if self.observer is not None:
            self.observer.add(q, k)
        if self.key_rotation is not None:
            q, k = self.key_rotation.apply(q, k)  # scores unchanged: q Tq . k Tk = q . k
        else:
            q, k = _rotated(q, rotation), _rotated(k, rotation)  # scores unchanged: qR . kR = q . k
        if not self.ops.kv_format.rotation_values:
            return self._attend(q, k, v, kv_cache, meta)
        # The output over turned values is sum(p vR) = (sum p v) R: turned back.
        return _rotated(self._attend(q, k, _rotated(v, rotation), kv_cache, meta), rotation.T)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
    ) -> torch.Tensor:
        self.ops.store_kv(k, v, *kv_cache, meta.slot_mapping)
        return self.attend(q, kv_cache, meta)

    def attend(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """q ``[T, Hq, D]`` over the cache, where the step's K/V are stored already -> ``[T, Hq, D]``."""
        k_cache, v_cache = kv_cache
        d = meta.num_decodes
        parts = []
        if d:
            parts.append(self.ops.decode(q[:d], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale,
                                         max_seq_len=meta.decode_max_seq_len, **self.extra))
        if q.shape[0] > d:
            parts.append(self.ops.prefill(
                q[d:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start,
                meta.prefill_seq_lens, self.scale, max_query_len=meta.prefill_max_query_len,
                max_seq_len=meta.prefill_max_seq_len, **self.extra,
            ))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _rotated(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``x @ rotation`` over the last dimension, in float32, back at ``x``'s dtype."""
    return (x.float() @ rotation).to(x.dtype)
