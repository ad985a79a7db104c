"""Plain PyTorch versions of the paged-KV kernels: the CPU path, and the oracle for the Triton ones.

Cache layout (one K and one V tensor per layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Block tables are ``int32 [num_seqs, max_blocks]``; a slot is ``block * block_size + offset``;
a negative slot means "skip" (padding). Attention accumulates in float32.
Everything is vectorised over the batch: no Python loop per sequence or token.
"""

from __future__ import annotations

import torch


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the cache slots."""
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, heads, dim).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, heads, dim).index_copy_(0, slots, value.to(v_cache.dtype))


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """``[num_seqs, max_len, num_kv_heads, head_dim]``: each sequence's first ``max_len`` slots."""
    block_size = cache.shape[1]
    num_blocks = -(-max_len // block_size)
    tables = block_tables[:, :num_blocks].long().clamp_min(0)  # padding entries point anywhere valid
    gathered = cache[tables]  # [S, nb, bs, H, D]
    return gathered.flatten(1, 2)[:, :max_len]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """q ``[S, Q, Hq, D]``, k/v ``[S, L, Hkv, D]``, allowed ``[S, Q, L]`` -> ``[S, Q, Hq, D]`` (float32)."""
    s, lq, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.float().view(s, lq, hkv, hq // hkv, d)
    scores = torch.einsum("sqkgd,slkd->skgql", qg, k.float()) * scale
    scores.masked_fill_(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # rows with nothing allowed (padding) -> 0
    out = torch.einsum("skgql,slkd->sqkgd", probs, v.float())
    return out.reshape(s, lq, hq, d)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence over its whole context. ``q``/``out``: ``[num_seqs, num_heads, head_dim]``."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    max_len = int(seq_lens.max())
    k = gather_context(k_cache, block_tables, max_len)
    v = gather_context(v_cache, block_tables, max_len)
    positions = torch.arange(max_len, device=q.device)
    allowed = (positions[None, :] < seq_lens[:, None].long())[:, None, :]
    return _attend(q[:, None], k, v, allowed, scale)[:, 0].to(q.dtype)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention for variable-length query chunks whose earlier tokens are already cached.

    ``q``: ``[num_tokens, num_heads, head_dim]``, the chunks of all sequences back to back;
    ``query_start_loc``: ``[num_seqs + 1]`` offsets into ``q``; ``seq_lens``: context length of
    each sequence *including* its chunk (whose K/V must already be stored in the cache).
    """
    if q.shape[0] == 0:
        return torch.empty_like(q)
    starts = query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    num_seqs, max_q, max_len = q_lens.shape[0], int(q_lens.max()), int(seq_lens.max())
    # Pad the chunks into [S, max_q]: row r of seq s is token starts[s] + r.
    rows = torch.arange(max_q, device=q.device)
    valid_q = rows[None, :] < q_lens[:, None]
    token_index = (starts[:-1, None] + rows[None, :]).clamp_max(q.shape[0] - 1)
    padded = q[token_index]  # [S, max_q, H, D]
    q_pos = seq_lens[:, None].long() - q_lens[:, None] + rows[None, :]  # absolute position of each query
    k_pos = torch.arange(max_len, device=q.device)
    allowed = (k_pos[None, None, :] <= q_pos[:, :, None]) & valid_q[:, :, None]
    k = gather_context(k_cache, block_tables, max_len)
    v = gather_context(v_cache, block_tables, max_len)
    out = _attend(padded, k, v, allowed, scale)
    return out[valid_q].to(q.dtype)


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
    """Copy-on-write: for every layer, block ``dst`` becomes a copy of block ``src`` (``pairs [N, 2]``)."""
    if pairs.numel() == 0:
        return
    src, dst = pairs[:, 0].long(), pairs[:, 1].long()
    for cache in (*k_caches, *v_caches):
        cache.index_copy_(0, dst.to(cache.device), cache[src.to(cache.device)])


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy blocks between two pools (GPU <-> CPU): ``dst_cache[d] = src_cache[s]`` for ``(s, d)`` in pairs."""
    if pairs.numel() == 0:
        return
    src = pairs[:, 0].long().to(src_cache.device)
    dst = pairs[:, 1].long().to(dst_cache.device)
    dst_cache.index_copy_(0, dst, src_cache[src].to(dst_cache.device))
