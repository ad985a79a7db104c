"""bf16 linear layers on the CPU: oneDNN-prepacked weights give exactly the plain layers' results
where the CPU has bf16 matrix instructions; float32-widened weights give the same products summed
in float32 where it has not; the loader picks one for bf16 models on the CPU (only there)."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pagedserve import LLM
from pagedserve.worker.runner.prepack import PrepackedLinear, WidenedLinear, can_prepack, prepack_linears, widen_linears

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


def test_the_loader_speeds_up_bf16_models_on_the_cpu_and_nothing_else(zoo):
    def layers_of(dtype):
        model = LLM(zoo.path("llama-gqa"), device="cpu", dtype=dtype, num_gpu_blocks=64).engine.runner.model
        kinds = [type(m) for m in model.modules()]
        return kinds.count(PrepackedLinear), kinds.count(WidenedLinear), kinds.count(nn.Linear)

    layers = len(LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=64).engine.runner.model.model.layers)
    linears = 7 * layers + 1  # q, k, v, o, gate, up, down per layer, and the head
    expected = (linears, 0, 0) if can_prepack(torch.device("cpu"), torch.bfloat16) else (0, linears, 0)
    assert layers_of("bfloat16") == expected
    assert layers_of("float32") == (0, 0, linears)
    assert not can_prepack(torch.device("meta"), torch.bfloat16) and not can_prepack(torch.device("cpu"), torch.float16)
