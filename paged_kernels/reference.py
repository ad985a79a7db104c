"""Plain PyTorch versions of the paged-KV kernels: the CPU path, and the oracle for the Triton ones.

Cache layout (one K and one V tensor per layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``
(a quantized cache: uint8 rows of ``head_dim + 2``, ``paged_kernels/kv_format.py``; the gathered context is
decoded to float32 before attending; with quantized products, ``quantized_products_reference.py``'s roundings instead).
Block tables are ``int32 [num_seqs, max_blocks]``; a slot is ``block * block_size + offset``;
a negative slot means "skip" (padding). Attention accumulates in float32.
Everything is vectorised over the batch: no Python loop per sequence or token (decode splits a
large batch into at most four groups of similar length to cut padding).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from pagedserve.kernels.quantized_products_reference import decode_products
from pagedserve.kernels.kv_format import AUTO, KVFormat


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_format: KVFormat = AUTO,
) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the cache slots
    (quantized into rows with their scale when ``kv_format`` says so)."""
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    if kv_format.quantized:
        key, value = kv_format.quantize_pair(key, value)
    heads, width = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, heads, width).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, heads, width).index_copy_(0, slots, value.to(v_cache.dtype))


class Workspace:
    """Reusable gather buffers. Fresh multi-megabyte tensors cost page faults on every call
    (measured: a 105 MB gather took 38 ms into new memory, 8 ms into a reused buffer)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def take(self, slot: str, shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or like.dtype
        key = (slot, dtype, like.device)
        numel = 1
        for n in shape:
            numel *= n
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype, device=like.device)
        return buf[:numel].view(shape)


def gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, max_len: int, workspace: Workspace | None = None, slot: str = "k"
) -> torch.Tensor:
    """``[num_seqs, max_len, num_kv_heads, head_dim]``: each sequence's first ``max_len`` slots."""
    block_size = cache.shape[1]
    num_blocks = -(-max_len // block_size)
    flat = block_tables[:, :num_blocks].reshape(-1).long().clamp_min(0)  # padding entries: any valid block
    shape = (flat.numel(), *cache.shape[1:])
    out = workspace.take(slot, shape, cache) if workspace is not None else None
    gathered = torch.index_select(cache, 0, flat, out=out) if out is not None else cache.index_select(0, flat)
    return gathered.view(block_tables.shape[0], num_blocks * block_size, *cache.shape[2:])[:, :max_len]


def _as_float(t: torch.Tensor, workspace: Workspace | None, slot: str) -> torch.Tensor:
    """``t`` in float32, copied into a reused buffer when it is not (a fresh one per call costs page
    faults on every layer)."""
    if t.dtype == torch.float32:
        return t
    if workspace is None:
        return t.float()
    return workspace.take(slot, tuple(t.shape), t, torch.float32).copy_(t)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
            workspace: Workspace | None = None, softcap: float = 0.0) -> torch.Tensor:
    """q ``[S, Q, Hq, D]``, k/v ``[S, L, Hkv, D]``, allowed ``[S, Q, L]`` -> ``[S, Q, Hq, D]`` (float32).

    In float32 whatever the cache dtype: this CPU kernel is twice as slow on bf16 inputs (measured,
    llama-med W64 decode: 239 ms a step against 116 ms). Rows with nothing allowed (padding
    queries) come out as garbage; callers drop them. ``softcap`` > 0: scores become
    ``softcap * tanh(score / softcap)`` before the softmax (Gemma 2), written out as matmuls since
    ``scaled_dot_product_attention`` has no such step."""
    qf, kf, vf = (_as_float(t, workspace, slot).transpose(1, 2) for t, slot in ((q, "qf"), (k, "kf"), (v, "vf")))
    if softcap > 0:
        group = qf.shape[1] // kf.shape[1]
        kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
        scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), vf).transpose(1, 2)
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=allowed[:, None], scale=scale,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def length_buckets(seq_lens: torch.Tensor, max_buckets: int = 4, min_size: int = 16) -> list[torch.Tensor | None]:
    """Index groups of similar length, so a short context is not padded to the longest one.
    ``[None]`` (everything at once) for small batches."""
    if seq_lens.shape[0] < 2 * min_size:
        return [None]
    count = min(max_buckets, seq_lens.shape[0] // min_size)
    return list(torch.tensor_split(torch.argsort(seq_lens), count))


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    workspace: Workspace | None = None,
    window: int = 0,
    softcap: float = 0.0,
    kv_format: KVFormat = AUTO,
) -> torch.Tensor:
    """One query token per sequence over its whole context. ``q``/``out``: ``[num_seqs, num_heads, head_dim]``.
    ``max_seq_len``: ``seq_lens.max()`` when the caller knows it (saves reading it back).
    ``window`` > 0: sliding-window attention, each query sees its last ``window`` positions (itself included).
    ``softcap`` > 0: scores capped with ``tanh`` (see ``_attend``)."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    buckets = length_buckets(seq_lens)
    if buckets == [None]:
        return _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, workspace, max_seq_len, window, softcap,
                       kv_format)
    out = torch.empty_like(q)
    for idx in buckets:
        out[idx] = _decode(q[idx], k_cache, v_cache, block_tables[idx], seq_lens[idx], scale, workspace, window=window,
                           softcap=softcap, kv_format=kv_format)
    return out


def gather_values(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int, workspace: Workspace | None,
                  slot: str, kv_format: KVFormat) -> torch.Tensor:
    """``gather_context``, decoded to float32 when the cache is quantized."""
    rows = gather_context(cache, block_tables, max_len, workspace, slot)
    if not kv_format.quantized:
        return rows
    out = workspace.take(slot + "f", (*rows.shape[:-1], kv_format.head_dim(cache)), rows, torch.float32) \
        if workspace is not None else None
    return kv_format.dequantize(rows, out)


def _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, workspace, max_len: int | None = None,
            window: int = 0, softcap: float = 0.0, kv_format: KVFormat = AUTO) -> torch.Tensor:
    max_len = max_len if max_len is not None else int(seq_lens.max())
    positions = torch.arange(max_len, device=q.device)
    lens = seq_lens[:, None].long()
    allowed = positions[None, :] < lens
    if window > 0:
        allowed &= positions[None, :] >= lens - window
    if kv_format.quantized_products:  # the codes' own products, as the Triton kernel takes them
        k_rows, v_rows = (gather_context(cache, block_tables, max_len) for cache in (k_cache, v_cache))
        return decode_products(q, k_rows, v_rows, allowed, scale, softcap, kv_format).to(q.dtype)
    k = gather_values(k_cache, block_tables, max_len, workspace, "k", kv_format)
    v = gather_values(v_cache, block_tables, max_len, workspace, "v", kv_format)
    return _attend(q[:, None], k, v, allowed[:, None, :], scale, workspace, softcap)[:, 0].to(q.dtype)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    workspace: Workspace | None = None,
    window: int = 0,
    softcap: float = 0.0,
    kv_format: KVFormat = AUTO,
) -> torch.Tensor:
    """Causal attention for variable-length query chunks whose earlier tokens are already cached
    (``window`` > 0: each query sees only its last ``window`` positions, itself included).

    ``q``: ``[num_tokens, num_heads, head_dim]``, the chunks of all sequences back to back;
    ``query_start_loc``: ``[num_seqs + 1]`` offsets into ``q``; ``seq_lens``: context length of
    each sequence *including* its chunk (whose K/V must already be stored in the cache).
    """
    if q.shape[0] == 0:
        return torch.empty_like(q)
    starts = query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    max_q = max_query_len if max_query_len is not None else int(q_lens.max())
    max_len = max_seq_len if max_seq_len is not None else int(seq_lens.max())
    # Pad the chunks into [S, max_q]: row r of seq s is token starts[s] + r.
    rows = torch.arange(max_q, device=q.device)
    valid_q = rows[None, :] < q_lens[:, None]
    token_index = (starts[:-1, None] + rows[None, :]).clamp_max(q.shape[0] - 1)
    padded = q[token_index]  # [S, max_q, H, D]
    q_pos = seq_lens[:, None].long() - q_lens[:, None] + rows[None, :]  # absolute position of each query
    k_pos = torch.arange(max_len, device=q.device)
    allowed = (k_pos[None, None, :] <= q_pos[:, :, None]) & valid_q[:, :, None]
    if window > 0:
        allowed &= k_pos[None, None, :] > q_pos[:, :, None] - window
    k = gather_values(k_cache, block_tables, max_len, workspace, "k", kv_format)
    v = gather_values(v_cache, block_tables, max_len, workspace, "v", kv_format)
    out = _attend(padded, k, v, allowed, scale, workspace, softcap)
    return out[valid_q].to(q.dtype)


def block_pairs(pairs, device: torch.device) -> torch.Tensor:
    """``(src, dst)`` block pairs as the ``[N, 2]`` int64 tensor ``copy_blocks`` and ``swap_blocks`` take."""
    return torch.tensor(pairs, dtype=torch.int64, device=device).view(-1, 2)


def copy_blocks(kv_pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy-on-write for every layer at once: block ``dst`` becomes a copy of block ``src``.

    ``kv_pool``: ``[2 * num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` (K and V of
    every layer); ``pairs``: int64 ``[N, 2]`` of ``(src, dst)``."""
    if pairs.numel() == 0:
        return
    pairs = pairs.to(kv_pool.device)
    kv_pool.index_copy_(1, pairs[:, 1].long(), kv_pool.index_select(1, pairs[:, 0].long()))


def swap_blocks(src_pool: torch.Tensor, dst_pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy blocks between two pools of the same layout (GPU <-> CPU), every layer at once:
    ``dst_pool[:, d] = src_pool[:, s]`` for ``(s, d)`` in ``pairs``.

    One gather on the source device, one transfer, one scatter. Into the CPU the transfer blocks:
    the host scatters right after it, so it must not read a buffer still being filled. Onto the
    GPU it is asynchronous from pinned memory and ordered before the next kernel on the stream."""
    if pairs.numel() == 0:
        return
    src = pairs[:, 0].long().to(src_pool.device)
    dst = pairs[:, 1].long().to(dst_pool.device)
    staged = src_pool.index_select(1, src)
    if dst_pool.device.type == "cpu":
        moved = staged.to(dst_pool.device)
    else:
        moved = (staged.pin_memory() if staged.device.type == "cpu" and torch.cuda.is_available() else staged).to(
            dst_pool.device, non_blocking=True)
    dst_pool.index_copy_(1, dst, moved)
