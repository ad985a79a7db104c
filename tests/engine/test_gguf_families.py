"""Every family the GGUF source serves, from a GGUF file: each random-weight test model is written
as llama.cpp's converter writes it (``tests/gguf_writer.py``), served from that one file, and
compared token for token with transformers on the original checkpoint. transformers' own GGUF
reader checks the writer where it reads the family fully, and reads the same 8-bit file we do."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM
from pagedserve.shared.sampling import SamplingParams
from tests.conftest import MODEL_SPECS, ModelZoo, random_prompts
from tests.gguf_writer import write_gguf

# what a GGUF can say: Gemma scales queries by the head size, a Qwen3-MoE file has no dense layers
GGUF_SPECS = {
    **{name: MODEL_SPECS[name] for name in ("llama-gqa", "llama-tied", "qwen2", "qwen3", "phi3", "mixtral", "qwen2-moe")},
    "gemma2": {**MODEL_SPECS["gemma2"], "query_pre_attn_scalar": 16},
    "gemma3": {**MODEL_SPECS["gemma3"], "query_pre_attn_scalar": 16},
    "qwen3-moe": {**MODEL_SPECS["qwen3-moe"], "mlp_only_layers": []},
}
# the families transformers' GGUF reader maps completely (it drops Gemma 2's soft caps, gives Gemma 3's local
# layers the global rope base, loses Phi-3's partial rotary, reads no Mixtral and no MoE expert sizes)
TRANSFORMERS_READS = ("llama-gqa", "llama-tied", "qwen2", "qwen3")
CASES = random_prompts(seed=5, count=4, max_len=60, vocab=512, max_new=24)


@pytest.fixture(scope="module")
def gguf_zoo(tmp_path_factory) -> ModelZoo:
    return ModelZoo(tmp_path_factory.mktemp("gguf-models"), GGUF_SPECS)


def served(path) -> list[list[int]]:
    llm = LLM(path, device="cpu", dtype="float32", num_gpu_blocks=128, seed=0)
    params = [SamplingParams(temperature=0.0, max_tokens=n) for _, n in CASES]
    return [o.outputs[0].token_ids for o in llm.generate([p for p, _ in CASES], params, use_tqdm=False)]


def hf_greedy_from_gguf(path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    out = []
    for prompt, n in CASES:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                    do_sample=False, pad_token_id=model.config.pad_token_id)
        out.append(tokens[0, len(prompt):].tolist())
    return out


@pytest.mark.parametrize("name", sorted(GGUF_SPECS))
def test_a_gguf_serves_as_its_checkpoint(gguf_zoo, tmp_path, name):
    gguf = write_gguf(gguf_zoo.path(name), tmp_path / f"{name}.gguf")
    expected = [gguf_zoo.hf_greedy(name, p, n) for p, n in CASES]
    assert served(gguf) == expected
    if name in TRANSFORMERS_READS:  # the writer wrote what llama.cpp's converter would
        assert hf_greedy_from_gguf(gguf) == expected


def test_an_8_bit_gguf_dequantizes_as_transformers_does(gguf_zoo, tmp_path):
    gguf = write_gguf(gguf_zoo.path("llama-gqa"), tmp_path / "q8.gguf", quantize="Q8_0")
    assert served(gguf) == hf_greedy_from_gguf(gguf)


def test_a_directory_holding_one_gguf_is_a_model(gguf_zoo, tmp_path):
    folder = tmp_path / "only-a-gguf"
    folder.mkdir()
    write_gguf(gguf_zoo.path("qwen2"), folder / "model-f32.gguf")
    assert served(folder) == [gguf_zoo.hf_greedy("qwen2", p, n) for p, n in CASES]
