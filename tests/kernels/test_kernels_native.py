"""The C kernels (the CPU path when a compiler is present) against plain per-sequence attention,
and their build cache. Skipped where no C compiler can build them."""

from __future__ import annotations

import shutil

import pytest
import torch

from pagedserve.kernels import native_build
from pagedserve.kernels.native_attention import PREFILL_KINDS, NativeAttention
from pagedserve.kernels.native_build import NativeKernelUnavailable
from tests.paged_cases import TOLERANCE, check_against_naive, dense_context, make_case, naive_attention

LENGTHS = [1, 15, 16, 17, 40, 97, 300]


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> NativeAttention:
    try:
        return NativeAttention(tmp_path_factory.mktemp("kernels"))
    except NativeKernelUnavailable as err:
        pytest.skip(f"no native kernels here: {err}")


@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 80])  # the kernel's two sizes compiled as constants, and another
def test_decode_matches_naive(native, block_size, heads, kv_heads, dtype, head_dim):
    case = make_case(LENGTHS, block_size, kv_heads, head_dim, dtype)
    q = torch.randn(len(LENGTHS), heads, head_dim).to(dtype)
    out = native.decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.125)
    assert out.dtype == dtype and out.shape == q.shape
    for s, n in enumerate(LENGTHS):
        k, v = dense_context(case, s)
        expected = naive_attention(q[s : s + 1], k, v, 0.125, q_start=n - 1)[0]
        torch.testing.assert_close(out[s].float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("block_size", [1, 7, 16])
# (16, 1): a group of 16 leaves tiles of 4 tokens, so a chunk of 30 spans eight (paged_prefill.c).
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (16, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_with_cached_prefix_matches_naive(native, block_size, heads, kv_heads, dtype):
    seq_lens = [5, 33, 48, 70]
    q_lens = [5, 1, 16, 30]  # whole prompt, a decode-like chunk, and chunks after a cached prefix
    case = make_case(seq_lens, block_size, kv_heads, 32, dtype)
    q = torch.randn(sum(q_lens), heads, 32).to(dtype)
    starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    out = native.prefill(q, case.k_cache, case.v_cache, case.block_tables, starts, case.seq_lens, 0.25)
    for s, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        k, v = dense_context(case, s)
        chunk = slice(int(starts[s]), int(starts[s + 1]))
        torch.testing.assert_close(out[chunk].float(), naive_attention(q[chunk], k, v, 0.25, n - ql),
                                   atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (16, 1), (4, 4)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (100, 0.0), (0, 20.0)])
def test_bfloat16_prefill_on_pair_products_matches_plain_attention(native, head_dim, heads, kv_heads, window, softcap):
    """Where the CPU has AMX tiles (and Linux grants them) or AVX512-BF16, bfloat16 prefill runs on
    pair products (csrc/paged_prefill_bf16.c): a whole prompt over many row blocks and key steps, a
    chunk after a prefix ending inside a step, a one-token chunk; windows and score caps as the
    vector kernel."""
    if native.prefill_kind == PREFILL_KINDS[0]:
        pytest.skip("neither AMX tiles nor AVX512-BF16 here: the vector kernel runs bfloat16 prefill")
    seq_lens, q_lens = [300, 170, 64], [300, 90, 1]
    case = make_case(seq_lens, 16, kv_heads, head_dim, torch.bfloat16)
    q = (torch.randn(sum(q_lens), heads, head_dim) * 2).to(torch.bfloat16)
    starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    scale = head_dim ** -0.5
    out = native.prefill(q, case.k_cache, case.v_cache, case.block_tables, starts, case.seq_lens, scale,
                         window=window, softcap=softcap)
    for s, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        k, v = dense_context(case, s)
        chunk = slice(int(starts[s]), int(starts[s + 1]))
        expected = naive_attention(q[chunk].float(), k.float(), v.float(), scale, n - ql, window, softcap)
        torch.testing.assert_close(out[chunk].float(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 16, 2)])
def test_pair_products_give_the_vector_kernels_outputs_but_for_a_rare_last_bit(native, tmp_path, head_dim, heads,
                                                                                 kv_heads):
    """The weights go through the second product as two bfloat16 parts (~16 bits): measured on this
    case, 0.15% of the outputs differ from the float32 vector kernel's, each by one unit of bfloat16;
    one part alone (flash attention's rounding) makes 29% differ, by up to a whole value."""
    if native.prefill_kind == PREFILL_KINDS[0]:
        pytest.skip("neither AMX tiles nor AVX512-BF16 here: the vector kernel runs bfloat16 prefill")
    vector = NativeAttention(tmp_path, pair_products=False)
    torch.manual_seed(0)
    case = make_case([600, 300], 16, kv_heads, head_dim, torch.bfloat16)
    q = (torch.randn(700, heads, head_dim) * 2).to(torch.bfloat16)
    starts = torch.tensor([0, 600, 700], dtype=torch.int32)
    args = (q, case.k_cache, case.v_cache, case.block_tables, starts, case.seq_lens, head_dim ** -0.5)
    pairs, plain = native.prefill(*args).float(), vector.prefill(*args).float()
    differ = pairs != plain
    assert differ.float().mean() < 0.01
    # one unit of bfloat16, or a few millionths where a sum of values of ~1 cancels to nearly nothing
    assert torch.all((pairs - plain).abs()[differ] <= plain.abs()[differ] * 2.0 ** -7 + 1e-5)


@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize("window", [1, 16, 33])
def test_sliding_window_decode_and_prefill_match_naive(native, block_size, window):
    """The window may start inside a block: the kernel reads from that position, not the block's start."""
    check_against_naive(native.decode, native.prefill, block_size, 6, 2, 32, 0.2, window=window)


def test_a_non_contiguous_query_is_read_correctly(native):
    case = make_case([20, 9], 4, 2, 16)
    fused = torch.randn(2, 3, 4, 16)  # as a fused QKV projection leaves q: a strided view
    q = fused[:, 0]
    out = native.decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.25)
    torch.testing.assert_close(out, native.decode(q.contiguous(), case.k_cache, case.v_cache, case.block_tables,
                                                  case.seq_lens, 0.25))


def test_a_context_longer_than_its_table_is_refused(native):
    case = make_case([20, 9], 4, 2, 16)
    q = torch.randn(2, 4, 16)
    too_long = torch.tensor([20, case.block_tables.shape[1] * 4 + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="does not fit block tables"):
        native.decode(q, case.k_cache, case.v_cache, case.block_tables, too_long, 0.25)
    with pytest.raises(ValueError, match="int32"):
        native.decode(q, case.k_cache, case.v_cache, case.block_tables.long(), case.seq_lens, 0.25)


def test_the_library_is_built_once_and_rebuilt_when_a_source_or_header_changes(native, tmp_path, monkeypatch):
    NativeAttention(tmp_path)
    built = sorted(tmp_path.glob("*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    NativeAttention(tmp_path)
    assert sorted(tmp_path.glob("*.so")) == built and built[0].stat().st_mtime_ns == stamp
    changed = tmp_path / "src"
    shutil.copytree(native_build.SOURCE_DIR, changed)
    (changed / "paged_common.h").write_text((changed / "paged_common.h").read_text() + "\n/* changed */\n")
    monkeypatch.setattr(native_build, "SOURCE_DIR", changed)
    NativeAttention(tmp_path)
    assert len(list(tmp_path.glob("*.so"))) == 2


def test_a_failing_compiler_is_a_clear_error(native, tmp_path, monkeypatch):
    broken = tmp_path / "src"
    broken.mkdir()
    (broken / "paged_attention.c").write_text("this is not C\n")
    monkeypatch.setattr(native_build, "SOURCE_DIR", broken)
    with pytest.raises(NativeKernelUnavailable, match="failed on paged_attention.c"):
        NativeAttention(tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*"))  # nothing half-written left behind


@pytest.mark.parametrize("window", [0, 16])
def test_soft_capped_scores_match_naive(native, window):
    """Gemma 2: each score becomes cap * tanh(score / cap) (a cap of 3 on large scores, so it bites)."""
    check_against_naive(native.decode, native.prefill, 7, 4, 2, 32, 0.3, window=window, softcap=3.0, q_scale=4.0)
