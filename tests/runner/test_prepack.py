"""bf16 linear layers with oneDNN-prepacked weights give exactly the plain layers' results, and the
loader uses them for bf16 models on the CPU (only there)."""

import pytest
import torch
from torch import nn

from pagedserve import LLM
from worker.runner.prepack import PrepackedLinear, can_prepack, prepack_linears

pytestmark = pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.bfloat16), reason="no oneDNN bf16 linear")


def test_prepacked_layers_are_bit_identical_to_plain_ones():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(96, 160), nn.Linear(160, 72, bias=False)).to(torch.bfloat16)
    packed = nn.Sequential(nn.Linear(96, 160), nn.Linear(160, 72, bias=False)).to(torch.bfloat16)
    packed.load_state_dict(plain.state_dict())
    assert prepack_linears(packed) == 2 and all(isinstance(m, PrepackedLinear) for m in packed)
    for rows in (1, 5, 64, 300):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        assert torch.equal(packed(x), plain(x))
    x = torch.randn(2, 3, 96, dtype=torch.bfloat16)  # leading dimensions are kept
    assert torch.equal(packed(x), plain(x)) and packed(x).shape == (2, 3, 72)


def test_the_loader_prepacks_bf16_models_on_the_cpu_and_nothing_else(zoo):
    def packed_layers(dtype):
        model = LLM(zoo.path("llama-gqa"), device="cpu", dtype=dtype, num_gpu_blocks=64).engine.runner.model
        return sum(isinstance(m, PrepackedLinear) for m in model.modules()), sum(type(m) is nn.Linear for m in model.modules())

    layers = len(LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=64).engine.runner.model.model.layers)
    assert packed_layers("bfloat16") == (7 * layers + 1, 0)  # q, k, v, o, gate, up, down per layer, and the head
    assert packed_layers("float32") == (0, 7 * layers + 1)
    assert not can_prepack(torch.device("meta"), torch.bfloat16) and not can_prepack(torch.device("cpu"), torch.float16)
