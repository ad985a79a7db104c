"""Random paged-KV setups for kernel tests: caches, block tables (some blocks shared between
sequences, padding entries), lengths that do and do not end on a block boundary, and a plain
per-sequence attention to check against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels import reference
from pagedserve.kernels.kv_format import kv_format


@dataclass
class PagedCase:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    seq_lens: torch.Tensor  # int32 [S]
    block_size: int


def make_case(
    seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype=torch.float32,
    device="cpu", seed: int = 0, share_first_block: bool = True,
) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(per_seq) + 1  # one padding column more than needed
    tables = torch.full((len(seq_lens), width), 0, dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = perm[used : used + n]
        used += n
    if share_first_block and len(seq_lens) > 1 and per_seq[1] > 1 and seq_lens[0] > block_size:
        tables[1, 0] = tables[0, 0]  # a block shared by two tables (as after a fork or prefix hit)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    return PagedCase(k.to(device), v.to(device), tables.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device), block_size)


def quantized_case(name: str, block_size: int, kv_heads: int, lengths: list[int], head_dim: int = 64):
    """A paged case whose caches went through ``store_kv`` quantized, and the same caches decoded."""
    fmt = kv_format(name)
    plain = make_case(lengths, block_size, kv_heads, head_dim)
    k_rows, v_rows = (torch.zeros((*c.shape[:3], fmt.row_width(head_dim)), dtype=torch.uint8)
                      for c in (plain.k_cache, plain.v_cache))
    slots = torch.arange(plain.k_cache.shape[0] * block_size)
    flat = lambda c: c.reshape(-1, kv_heads, head_dim)  # noqa: E731
    reference.store_kv(flat(plain.k_cache), flat(plain.v_cache), k_rows, v_rows, slots, kv_format=fmt)
    plain.k_cache, plain.v_cache = fmt.dequantize(k_rows), fmt.dequantize(v_rows)
    return plain, k_rows, v_rows


def dense_context(case: PagedCase, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[len, Hkv, D]`` of one sequence, read block by block."""
    n, bs = int(case.seq_lens[seq]), case.block_size
    rows = [int(case.block_tables[seq, p // bs]) for p in range(n)]
    offs = [p % bs for p in range(n)]
    return case.k_cache[rows, offs].float(), case.v_cache[rows, offs].float()


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_start: int,
                    window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q ``[Q, Hq, D]`` at positions ``q_start..`` over k/v ``[L, Hkv, D]``, causal (and within the
    last ``window`` positions when ``window`` > 0); float32."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,lhd->hql", q.float(), k) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    pos_q = torch.arange(q.shape[0])[:, None] + q_start
    pos_k = torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill(pos_k > pos_q, float("-inf"))
    if window > 0:
        scores = scores.masked_fill(pos_k <= pos_q - window, float("-inf"))
    return torch.einsum("hql,lhd->qhd", torch.softmax(scores, dim=-1), v)


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


WINDOW_LENGTHS = [1, 9, 16, 17, 40, 97, 600]  # shorter than, equal to and past the windows tested


def check_against_naive(decode, prefill, block_size: int, heads: int, kv_heads: int, dim: int, scale: float,
                        window: int = 0, softcap: float = 0.0, q_scale: float = 1.0) -> None:
    """An ops pair (decode, prefill) against plain attention, float32: decode over contexts shorter
    and longer than ``window``, prefill chunks after cached prefixes; ``softcap`` and ``window``
    passed by name (``q_scale`` > 1 makes scores large enough for a cap to change them)."""
    case = make_case(WINDOW_LENGTHS, block_size, kv_heads, dim)
    q = torch.randn(len(WINDOW_LENGTHS), heads, dim) * q_scale
    out = decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale, window=window, softcap=softcap)
    for seq in range(q.shape[0]):
        k, v = dense_context(case, seq)
        expected = naive_attention(q[seq : seq + 1], k, v, scale, k.shape[0] - 1, window, softcap)[0]
        torch.testing.assert_close(out[seq], expected, atol=2e-5, rtol=2e-5)
    seq_lens, q_lens = [5, 33, 48, 70], [5, 1, 16, 30]  # whole prompts, a one-token chunk, chunks after a prefix
    case = make_case(seq_lens, block_size, kv_heads, dim)
    q = torch.randn(sum(q_lens), heads, dim) * q_scale
    starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    out = prefill(q, case.k_cache, case.v_cache, case.block_tables, starts, case.seq_lens, scale, window=window,
                  softcap=softcap)
    for seq, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        k, v = dense_context(case, seq)
        chunk = slice(int(starts[seq]), int(starts[seq + 1]))
        torch.testing.assert_close(out[chunk], naive_attention(q[chunk], k, v, scale, n - ql, window, softcap),
                                   atol=2e-5, rtol=2e-5)
