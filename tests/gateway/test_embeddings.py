"""``/v1/embeddings`` with the official ``openai`` SDK against a live stack, and ``LLM.embed``:
vectors equal transformers' final hidden states pooled the same way (last token or mean) and
normalised, float32 within 1e-5; long prompts in chunks, after a generation cached their blocks
(an embedding computes its prompt in full); bad requests are 400s naming the field."""

from __future__ import annotations

import httpx
import pytest
import torch

from pagedserve.worker.llm import LLM
from tests.service_helpers import MODEL_NAME

MODEL = "llama-gqa"  # the stack's model (tests/gateway/conftest.py)


@pytest.fixture(scope="module")
def reference(zoo):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(zoo.path(MODEL)), torch_dtype=torch.float32).eval()

    def embed(ids: list[int], pooling: str = "last") -> torch.Tensor:
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        return torch.nn.functional.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=0)

    return embed


def ids_of(stack, text: str) -> list[int]:
    return httpx.post(stack.url + "/tokenize", json={"prompt": text}).json()["tokens"]


def test_the_sdk_gets_transformers_last_token_states(stack, client, reference):
    texts = ["pages are blocks", "a block table maps a sequence to its blocks " * 8]
    got = client.embeddings.create(model=MODEL_NAME, input=texts)  # the SDK asks for base64 and decodes it
    assert [d.index for d in got.data] == [0, 1] and got.usage.prompt_tokens == sum(len(ids_of(stack, t)) for t in texts)
    for text, item in zip(texts, got.data):
        assert torch.allclose(torch.tensor(item.embedding), reference(ids_of(stack, text)), atol=1e-5)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_float_vectors_of_token_ids_and_mean_pooling(stack, reference, pooling):
    prompts = [[5, 6, 7, 8, 9] * 20, [11, 12, 13]]
    r = httpx.post(stack.url + "/v1/embeddings", json={"model": MODEL_NAME, "input": prompts, "encoding_format": "float",
                                                       "pooling": pooling})
    assert r.status_code == 200, r.text
    for ids, item in zip(prompts, r.json()["data"]):
        assert torch.allclose(torch.tensor(item["embedding"]), reference(ids, pooling), atol=1e-5)


def test_offline_embeddings_are_computed_in_full_in_chunks_after_a_cached_generation(zoo, reference):
    from pagedserve.shared.sampling import SamplingParams

    llm = LLM(str(zoo.path(MODEL)), device="cpu", dtype="float32", num_gpu_blocks=256, max_num_batched_tokens=64)
    prompt = [7, 8, 9, 10] * 40  # 160 tokens: three chunks
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # its blocks now cached
    for pooling in ("mean", "last"):
        vector, = llm.embed([prompt], pooling, use_tqdm=False)
        assert torch.allclose(torch.tensor(vector), reference(prompt, pooling), atol=1e-5), pooling
    cached = set(llm.engine.cached_hashes())
    llm.embed([[20, 21, 22, 23] * 40], use_tqdm=False)
    assert set(llm.engine.cached_hashes()) == cached  # an embedding's KV is not kept after it


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"), ({"input": "x", "pooling": "cls"}, "pooling"),
    ({"input": ["x"] * 65}, "input"),
])
def test_bad_requests_are_400s_naming_the_field(stack, body, param):
    r = httpx.post(stack.url + "/v1/embeddings", json={"model": MODEL_NAME, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
