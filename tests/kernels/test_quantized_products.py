"""Decode attention with quantized products (``paged_kernels/quantized_products.py``) over int8 and
fp8_e4m3 caches: the Triton kernel against its torch reference (``quantized_products_reference.py``),
under TRITON_INTERPRET=1 on the CPU and on CUDA (``gpu`` marker), and an engine on it against the
reference engine."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_devices import DEVICES  # first: it picks the interpreter on a CPU

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from pagedserve.kernels import reference as ref  # noqa: E402
from pagedserve.kernels.kv_format import kv_format  # noqa: E402
from pagedserve.kernels.paged_attention import paged_attention_decode  # noqa: E402
from pagedserve.kernels.paged_tiles import code_constants, interpreted  # noqa: E402
from pagedserve.kernels.quantized_products import to_codes  # noqa: E402
from pagedserve.kernels.quantized_products_reference import to_codes as reference_codes  # noqa: E402
from tests.paged_cases import quantized_case  # noqa: E402

NAMES = ["int8", "fp8_e4m3"]


@triton.jit
def _rounded(x_ptr, out_ptr, N: tl.constexpr, CODE: tl.constexpr, INTERPRETED: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, to_codes(tl.load(x_ptr + i), CODE, INTERPRETED).to(tl.uint8, bitcast=True))


def rounding_edges(name: str) -> torch.Tensor:
    """Every finite value of the format's codes, the midpoints between neighbours (ties: to even), a
    float32 step either side of each midpoint (where e4m3's carry crosses into the next power of
    two), and values past the largest code (saturated)."""
    fmt = kv_format(name)
    values = fmt.table()
    values = values[values.isfinite()].unique()
    mids = (values[1:] + values[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    past = torch.tensor([1.01, 1.04, 1.2, 1e4, -1.01, -1e4]) * fmt.largest
    return torch.cat([values, near, past, torch.tensor([2.0 ** -12])])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", NAMES)
def test_the_kernels_rounding_to_codes_is_the_references(device, name):
    """``to_codes`` gives torch's rounding (nearest, ties to even; saturated) on every value that
    decides one: int8 by adding and taking away 1.5 * 2**23; e4m3 by the hardware's conversion on a
    GPU, by the float32 grid under the interpreter, whose own conversion turns 0.498 into 0.25 (a
    carry into the exponent dropped)."""
    fmt = kv_format(name)
    x = rounding_edges(name)
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, x.new_zeros(n - x.numel())])
    out = torch.empty(n, dtype=torch.uint8, device=device)
    _rounded[(1,)](x.to(device), out, n, code_constants(fmt, device)["CODE"], interpreted())
    got = fmt.table()[out.cpu().long()]
    expected = reference_codes(x, fmt)
    wrong = (got != expected).nonzero().flatten()[:5]
    assert not len(wrong), [(x[i].item(), got[i].item(), expected[i].item()) for i in wrong]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("head_dim,heads,kv_heads,block_size", [(64, 6, 2, 16), (80, 8, 2, 1), (128, 4, 1, 8), (256, 2, 1, 16)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (40, 0.0), (0, 3.0)])
def test_decode_with_quantized_products_gives_the_references_numbers(device, name, head_dim, heads, kv_heads,
                                                                     block_size, window, softcap):
    """float32 queries (quantized inside), slices of 128 tokens: the kernel's output is the
    reference's up to the order of float32 sums, while both are measurably off the exact path over
    the same cache (the roundings happened)."""
    torch.manual_seed(0)
    lengths = [1, 9, 33, 97, 300]
    exact, products = kv_format(name), kv_format(name, quantized_products=True)
    case, k_rows, v_rows = quantized_case(name, block_size, kv_heads, lengths, head_dim)
    q = torch.randn(len(lengths), heads, head_dim) * (3.0 if softcap else 1.0)
    args = (case.block_tables, case.seq_lens, 0.125)
    extra = {"window": window, "softcap": softcap}
    out = paged_attention_decode(q.to(device), k_rows.to(device), v_rows.to(device), *(a.to(device) for a in args[:2]),
                                 0.125, partition=128, kv_format=products, **extra).cpu()
    expected = ref.paged_attention_decode(q, k_rows, v_rows, *args, kv_format=products, **extra)
    decoded = ref.paged_attention_decode(q, k_rows, v_rows, *args, kv_format=exact, **extra)
    # The kernel's running maximum is not the reference's final one, so a weight a float32 step from a
    # rounding tie may land on the other code: a rare query's row off by a code's share, none by more
    # (at most one row in 144 runs of these cases under the interpreter; 3.5e-3 at most).
    off = (out - expected).abs()
    rows_off = int((off > 2e-5 + 2e-5 * expected.abs()).any(-1).sum())
    assert rows_off <= max(2, off.shape[0] * off.shape[1] // 10) and off.max() < 1e-2, (rows_off, off.max())
    assert (expected - decoded).abs().max() > 1e-3
    # one key (the first sequence): its weight is the largest code exactly, so the value comes back as stored
    torch.testing.assert_close(out[0], decoded[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_queries_come_out_within_a_rounding_of_the_reference(device, name):
    torch.manual_seed(0)
    products = kv_format(name, quantized_products=True)
    case, k_rows, v_rows = quantized_case(name, 16, 2, [5, 70, 200])
    q = torch.randn(3, 8, 64).to(torch.bfloat16)
    out = paged_attention_decode(q.to(device), k_rows.to(device), v_rows.to(device), case.block_tables.to(device),
                                 case.seq_lens.to(device), 0.125, kv_format=products).cpu()
    expected = ref.paged_attention_decode(q, k_rows, v_rows, case.block_tables, case.seq_lens, 0.125, kv_format=products)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=0, rtol=2 ** -7)  # a bfloat16 step either way


def test_quantized_products_take_an_int8_or_e4m3_cache_and_a_kernel_that_has_them():
    for name in ("auto", "fp8_e5m2"):
        with pytest.raises(ValueError, match="int8 or fp8_e4m3"):
            kv_format(name, quantized_products=True)
    products = kv_format("fp8_e4m3", quantized_products=True)
    assert kv_format("fp8", "cuda", quantized_products=True) == products.aligned()
    from pagedserve.kernels.ops import select_ops
    from pagedserve.worker.setup.engine_config import EngineConfig

    with pytest.raises(ValueError, match="torch reference"):
        select_ops(torch.device("cpu"), "native", kv_format=products)
    with pytest.raises(ValueError, match="torch reference"):
        select_ops(torch.device("cpu"), "auto", kv_format=products)
    assert select_ops(torch.device("cpu"), "torch", kv_format=products).kv_format.quantized_products
    with pytest.raises(ValueError, match="kv_cache_dtype int8, fp8 or fp8_e4m3"):
        EngineConfig("m", quantized_products=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", NAMES)
def test_an_engine_on_quantized_products_decodes_as_the_torch_reference_does(zoo, device, name):
    """The same bytes stored, the same roundings: the Triton engine's greedy tokens and their
    logprobs are the reference engine's over chunked prefill, a cached prefix and decode steps on the
    codes (the runner's ops carry the flag, and the exact path's logprobs over the same cache differ)."""
    from pagedserve import LLM
    from pagedserve.shared.sampling import SamplingParams
    from tests.conftest import random_prompts

    cases = random_prompts(seed=12, count=4, max_len=40, vocab=512, max_new=6)
    prompts = [p for p, _ in cases]
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=0) for _, n in cases]
    runs = {}
    for run, backend, where, products in (("triton", "triton", device, True), ("torch", "torch", "cpu", True),
                                          ("exact", "torch", "cpu", False)):
        llm = LLM(zoo.path("llama-gqa"), dtype="float32", device=where, attention_backend=backend, block_size=8,
                  num_gpu_blocks=64, max_num_batched_tokens=24, kv_cache_dtype=name, quantized_products=products)
        assert llm.engine.runner.ops.kv_format.quantized_products == products
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        runs[run] = ([o.token_ids for o in outs],
                      torch.tensor([e[t].logprob for o in outs for t, e in zip(o.token_ids, o.logprobs)]))
    assert runs["triton"][0] == runs["torch"][0]
    torch.testing.assert_close(runs["triton"][1], runs["torch"][1], atol=2e-5, rtol=0)
    if runs["exact"][0] == runs["torch"][0]:
        assert (runs["exact"][1] - runs["torch"][1]).abs().max() > 5e-5
