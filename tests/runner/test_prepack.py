"""Linear layers on the CPU: oneDNN-prepacked bf16 weights give exactly the plain layers' results
where the CPU has bf16 matrix instructions, prepacked float32 ones the same sums in oneDNN's order;
float32-widened weights give the bf16 products summed in float32 where it has not; the loader picks
by the CPU's flags, not by what oneDNN accepts."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pagedserve import LLM
from pagedserve.worker.runner.cpu.prepack import (
    PanelLinear,
    PrepackedLinear,
    WidenedLinear,
    bf16_in_hardware,
    can_prepack,
    cpu_flags,
    fast_cpu_linears,
    gemm_rows,
    prepack_linears,
    widen_linears,
)

needs_prepack = pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.bfloat16), reason="no oneDNN bf16 linear")


def twin_layers() -> tuple[nn.Sequential, nn.Sequential]:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(96, 160), nn.Linear(160, 72, bias=False)).to(torch.bfloat16)
    other = nn.Sequential(nn.Linear(96, 160), nn.Linear(160, 72, bias=False)).to(torch.bfloat16)
    other.load_state_dict(plain.state_dict())
    return plain, other


@needs_prepack
def test_prepacked_layers_are_bit_identical_to_plain_ones():
    plain, packed = twin_layers()
    assert prepack_linears(packed) == 2 and all(isinstance(m, PrepackedLinear) for m in packed)
    for rows in (1, 5, 64, 300):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        assert torch.equal(packed(x), plain(x))
    x = torch.randn(2, 3, 96, dtype=torch.bfloat16)  # leading dimensions are kept
    assert torch.equal(packed(x), plain(x)) and packed(x).shape == (2, 3, 72)


def test_widened_layers_compute_the_bf16_products_in_float32():
    plain, widened = twin_layers()
    assert widen_linears(widened) == 2 and all(isinstance(m, WidenedLinear) for m in widened)
    assert all(m.weight.dtype == torch.float32 for m in widened)
    (w1, b1), w2 = (plain[0].weight.float(), plain[0].bias.float()), plain[1].weight.float()
    for shape in ((1, 96), (64, 96), (2, 3, 96)):
        x = torch.randn(*shape, dtype=torch.bfloat16)
        hidden = F.linear(x.float(), w1, b1).to(torch.bfloat16)  # each layer rounds its output to bf16
        expected = F.linear(hidden.float(), w2).to(torch.bfloat16)
        got = widened(x)
        assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
        torch.testing.assert_close(got.float(), plain(x).float(), atol=0.05, rtol=0.02)  # a bf16 GEMM, other order


def test_prepacked_float32_layers_agree_with_plain_ones():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(96, 160), nn.Linear(160, 72, bias=False))
    packed = nn.Sequential(nn.Linear(96, 160), nn.Linear(160, 72, bias=False))
    packed.load_state_dict(plain.state_dict())
    assert prepack_linears(packed) == 2
    for rows in (1, 64, 17, 300):  # the last two padded (gemm_rows)
        x = torch.randn(rows, 96)
        torch.testing.assert_close(packed(x), plain(x), atol=1e-5, rtol=1e-5)  # the same sums, in another order


def test_gemm_row_counts_are_few_and_pad_little():
    """oneDNN keeps a primitive per shape: a worker meeting every row count up to 2,048 must meet
    a bounded few, each at most 12.5% larger than asked for."""
    counts = [gemm_rows(rows) for rows in range(1, 2049)]
    assert counts[:16] == list(range(1, 17))  # decode batches run as they are
    assert all(rows <= got < rows * 1.125 for rows, got in enumerate(counts[16:], start=17))
    assert counts == sorted(counts) and len(set(counts)) <= 16 + 8 * 7


def test_prepacked_layers_run_their_gemm_at_few_row_counts():
    torch.manual_seed(0)
    plain = nn.Linear(48, 40)
    packed = PrepackedLinear(plain, 64)
    seen = set()
    gemm = packed.gemm
    packed.gemm = lambda rows: seen.add(rows.shape[0]) or gemm(rows)
    for rows in range(1, 301):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(packed(x), plain(x), atol=1e-5, rtol=1e-5)
    assert seen == {gemm_rows(rows) for rows in range(1, 301)} and len(seen) < 60


def test_the_choice_reads_the_cpus_flags_not_what_onednn_accepts():
    cpuinfo = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    assert cpu_flags(cpuinfo) == {"fpu", "avx2", "avx512f", "avx512_vnni"} and cpu_flags("no flags here") == set()
    assert not bf16_in_hardware(cpu_flags(cpuinfo))  # AVX-512 without BF16: oneDNN takes the reorder, then emulates
    assert bf16_in_hardware(frozenset({"avx512f", "avx512_bf16"})) and bf16_in_hardware(frozenset({"amx_bf16"}))
    assert bf16_in_hardware(frozenset({"avx2", "avx_ne_convert"}))
    cpu = torch.device("cpu")
    no_bf16 = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)
    assert fast_cpu_linears(no_bf16, cpu, torch.bfloat16, flags=frozenset({"avx512f"})) == "widened"
    assert isinstance(no_bf16[0], WidenedLinear)
    if can_prepack(cpu, torch.bfloat16):
        with_bf16 = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)
        assert fast_cpu_linears(with_bf16, cpu, torch.bfloat16, flags=frozenset({"avx512_bf16"})) == "prepacked"
    assert fast_cpu_linears(nn.Sequential(nn.Linear(8, 8)), torch.device("meta"), torch.float32) is None


def test_the_loader_speeds_up_cpu_models_and_nothing_else(zoo):
    def layers_of(dtype, **options):
        model = LLM(zoo.path("llama-gqa"), device="cpu", dtype=dtype, num_gpu_blocks=64, **options).engine.runner.model
        kinds = [type(m) for m in model.modules()]
        return kinds.count(PrepackedLinear), kinds.count(WidenedLinear), kinds.count(nn.Linear)

    layers = len(LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=64).engine.runner.model.model.layers)
    linears = 4 * layers + 1  # q/k/v fused, o, gate/up fused, down per layer (fuse_projections), and the head
    fast_bf16 = bf16_in_hardware() and can_prepack(torch.device("cpu"), torch.bfloat16)
    # float32 and bfloat16 run on the C kernel where it builds (PanelLinear); without it (the torch
    # backend here), oneDNN's prepacked weights, or bfloat16 widened where the CPU has no bf16 instructions
    for dtype in ("float32", "bfloat16"):
        model = LLM(zoo.path("llama-gqa"), device="cpu", dtype=dtype, num_gpu_blocks=64).engine.runner.model
        assert [type(m) for m in model.modules()].count(PanelLinear) == linears
    assert layers_of("bfloat16", attention_backend="torch") == ((linears, 0, 0) if fast_bf16 else (0, linears, 0))
    assert layers_of("float32", attention_backend="torch") == (
        (linears, 0, 0) if can_prepack(torch.device("cpu"), torch.float32) else (0, 0, linears))
    assert layers_of("float16") == (0, 0, linears)
    assert not can_prepack(torch.device("meta"), torch.bfloat16) and not can_prepack(torch.device("cpu"), torch.float16)
