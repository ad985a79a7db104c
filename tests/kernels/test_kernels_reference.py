"""The torch references (the CPU path) against plain per-sequence attention."""

import pytest
import torch

from pagedserve.kernels import reference as ref
from tests.paged_cases import TOLERANCE, check_against_naive, dense_context, make_case, naive_attention

LENGTHS = [1, 15, 16, 17, 40, 97]


@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_matches_naive(block_size, heads, kv_heads, dtype):
    case = make_case(LENGTHS, block_size, kv_heads, 32, dtype)
    q = torch.randn(len(LENGTHS), heads, 32).to(dtype)
    out = ref.paged_attention_decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.2)
    for s, n in enumerate(LENGTHS):
        k, v = dense_context(case, s)
        expected = naive_attention(q[s : s + 1], k, v, 0.2, q_start=n - 1)[0]
        torch.testing.assert_close(out[s].float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_decode_buckets_and_workspace_give_the_same_answer():
    lengths = [int(x) for x in torch.randint(1, 300, (70,), generator=torch.Generator().manual_seed(1))]
    case = make_case(lengths, 16, 2, 64)
    q = torch.randn(len(lengths), 4, 64)
    assert len(ref.length_buckets(case.seq_lens)) == 4
    workspace = ref.Workspace()
    plain = ref.paged_attention_decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.125)
    for _ in range(2):  # the second call reuses the buffers
        again = ref.paged_attention_decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.125, workspace)
        torch.testing.assert_close(again, plain)
    for s in (0, 33, 69):
        k, v = dense_context(case, s)
        torch.testing.assert_close(plain[s], naive_attention(q[s : s + 1], k, v, 0.125, lengths[s] - 1)[0], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_prefill_with_cached_prefix_matches_naive(block_size, heads, kv_heads):
    seq_lens = [5, 33, 48, 70]
    q_lens = [5, 1, 16, 30]  # whole prompt, a decode-like chunk, and chunks after a cached prefix
    case = make_case(seq_lens, block_size, kv_heads, 16)
    q = torch.randn(sum(q_lens), heads, 16)
    starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    out = ref.prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, starts, case.seq_lens, 0.25)
    for s, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        k, v = dense_context(case, s)
        chunk = q[int(starts[s]) : int(starts[s + 1])]
        torch.testing.assert_close(out[int(starts[s]) : int(starts[s + 1])], naive_attention(chunk, k, v, 0.25, n - ql),
                                   atol=2e-5, rtol=2e-5)


def test_store_kv_skips_negative_slots():
    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros(4, 2, 1, 3)
    key = torch.arange(9.0).view(3, 1, 3)
    slots = torch.tensor([5, -1, 0])
    ref.store_kv(key, -key, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 1, 3)[5], key[0]) and torch.equal(k_cache.view(-1, 1, 3)[0], key[2])
    assert torch.equal(v_cache.view(-1, 1, 3)[5], -key[0])
    assert k_cache.abs().sum() == key[0].sum() + key[2].sum()


def test_copy_and_swap_blocks():
    pool = torch.randn(4, 5, 2, 1, 3)  # 2 layers x (K, V), 5 blocks
    before = pool.clone()
    ref.copy_blocks(pool, torch.tensor([[0, 3], [1, 4]]))
    assert torch.equal(pool[:, 3], before[:, 0]) and torch.equal(pool[:, 4], before[:, 1])
    assert torch.equal(pool[:, :3], before[:, :3])
    cpu = torch.zeros(4, 3, 2, 1, 3)
    ref.swap_blocks(pool, cpu, torch.tensor([[2, 0], [4, 2]]))
    assert torch.equal(cpu[:, 0], pool[:, 2]) and torch.equal(cpu[:, 2], pool[:, 4]) and cpu[:, 1].abs().sum() == 0


@pytest.mark.parametrize("window", [1, 16, 33])
def test_sliding_window_decode_and_prefill_match_naive(window):
    check_against_naive(ref.paged_attention_decode, ref.prefill_attention, 7, 4, 2, 16, 0.25, window=window)


@pytest.mark.parametrize("window", [0, 16])
def test_soft_capped_scores_match_naive(window):
    """Gemma 2: each score becomes cap * tanh(score / cap) (a cap of 3 on large scores, so it bites)."""
    check_against_naive(ref.paged_attention_decode, ref.prefill_attention, 7, 4, 2, 32, 0.3, window=window, softcap=3.0,
                        q_scale=4.0)
