"""LoRA adapters through the gateway: a worker started with ``--lora-modules`` lists its adapters in
its WorkerInfo, ``/v1/models`` shows them with the model as their ``parent``, and a request naming
an adapter as its ``model`` runs under it, as the offline engine does."""

from __future__ import annotations


import httpx
import openai
import pytest
import redis

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.shared.keys import Keys
from tests.gateway_stack import running_stack
from tests.lora_helpers import ALL_TARGETS, make_adapter
from tests.service_helpers import MODEL_NAME, poll

PROMPT = [21, 40, 7, 300, 11, 90, 5, 77, 64, 12]


@pytest.fixture(scope="module")
def adapter_path(zoo, tmp_path_factory):
    path = tmp_path_factory.mktemp("adapters") / "sql"
    make_adapter(zoo, "llama-gqa", path, 8, ALL_TARGETS, seed=3)
    return path


@pytest.fixture(scope="module")
def lora_stack(zoo, adapter_path, tmp_path_factory):
    with running_stack(tmp_path_factory, zoo.path("llama-gqa"), num_gpu_blocks=256, enable_lora=True,
                       lora_modules=(f"sql={adapter_path}",)) as stack:
        yield stack


def test_models_lists_the_adapters_under_their_model(lora_stack):
    client = openai.OpenAI(base_url=lora_stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    models = {m.id: m for m in client.models.list().data}
    assert models["sql"].parent == MODEL_NAME and models[MODEL_NAME].parent is None


def test_a_request_naming_an_adapter_runs_under_it(lora_stack, zoo, adapter_path):
    client = openai.OpenAI(base_url=lora_stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    offline = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=64, enable_lora=True)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = offline.generate([PROMPT], params, lora_request=LoRARequest("sql", 1, str(adapter_path)), use_tqdm=False)[0]
    base = offline.generate([PROMPT], params, use_tqdm=False)[0]
    assert want.outputs[0].token_ids != base.outputs[0].token_ids  # the adapter changes the answer
    for model, expected in (("sql", want), (MODEL_NAME, base)):
        got = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})
        assert got.model == model and got.choices[0].text == expected.outputs[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt=PROMPT, max_tokens=12, temperature=0.0, stream=True, extra_body={"ignore_eos": True}) if c.choices)
        assert streamed == expected.outputs[0].text
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="not-an-adapter", prompt=PROMPT, max_tokens=2)


def post(url: str, path: str, body) -> tuple[int, str]:
    import httpx

    got = httpx.post(url + path, json=body, timeout=60)
    return got.status_code, got.text


def test_adapters_load_and_unload_at_run_time_on_every_worker(lora_stack, zoo, tmp_path):
    """``/v1/load_lora_adapter`` puts an adapter in the model's registry and answers once the worker
    holds it; a bad directory is a 400 with the worker's reason and is taken back; ``unload`` takes
    it off again."""
    client = openai.OpenAI(base_url=lora_stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    path = tmp_path / "chat"
    make_adapter(zoo, "llama-gqa", path, 4, ["q_proj", "down_proj"], seed=9)
    offline = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=64, enable_lora=True)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = offline.generate([PROMPT], params, lora_request=LoRARequest("chat", 1, str(path)), use_tqdm=False)[0]

    assert post(lora_stack.url, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(path)}) == \
        (200, "Success: LoRA adapter 'chat' added successfully.")
    assert {m.id: m.parent for m in client.models.list().data}["chat"] == MODEL_NAME
    got = client.completions.create(model="chat", prompt=PROMPT, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
    assert got.choices[0].text == want.outputs[0].text
    status, text = post(lora_stack.url, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(path)})
    assert status == 400 and "already loaded" in text

    status, text = post(lora_stack.url, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path / "none")})
    assert status == 400 and "not a directory" in text
    assert "bad" not in {m.id for m in client.models.list().data}
    r = redis.Redis.from_url(lora_stack.redis.url)
    assert sorted(r.hkeys(Keys().adapters(MODEL_NAME))) == [b"chat", b"sql"]  # "bad" taken back
    assert r.hlen(Keys().adapter_errors(MODEL_NAME)) == 0  # the reason went to the caller, and was taken back
    for bad in ({"lora_name": "", "lora_path": "x"}, {"lora_name": "a=b", "lora_path": "x"}, {"lora_path": "x"},
                {"lora_name": 3, "lora_path": "x"}, {"lora_name": "c", "lora_path": ""}, []):
        status, text = post(lora_stack.url, "/v1/load_lora_adapter", bad)
        assert status == 400 and ("lora_" in text or "the body" in text), (bad, text)
    spec = httpx.get(lora_stack.url + "/openapi.json", timeout=10).json()
    assert spec["paths"]["/v1/load_lora_adapter"]["post"]["requestBody"]["content"]["application/json"]["schema"] == \
        {"$ref": "#/components/schemas/LoadLoraAdapterRequest"}
    assert set(spec["components"]["schemas"]["LoadLoraAdapterRequest"]["required"]) == {"lora_name", "lora_path"}
    assert "/v1/unload_lora_adapter" in spec["paths"]

    assert post(lora_stack.url, "/v1/unload_lora_adapter", {"lora_name": "chat"}) == \
        (200, "Success: LoRA adapter 'chat' removed successfully.")
    assert "chat" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="chat", prompt=PROMPT, max_tokens=2)
    status, text = post(lora_stack.url, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 404 and "no LoRA adapter named 'chat'" in text


def test_an_adapter_in_use_is_unloaded_when_its_requests_end(lora_stack, monkeypatch):
    """Unloading waits for the requests running under the adapter: past the wait the answer is a 202,
    and the worker unloads it at a heartbeat after they end. (Last here: it takes "sql" away.)"""
    from pagedserve.gateway.routes import lora as lora_api

    monkeypatch.setattr(lora_api, "WAIT_S", 0.5)
    client = openai.OpenAI(base_url=lora_stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.completions.create(model="sql", prompt=PROMPT, max_tokens=300, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))  # running under the adapter now
    status, text = post(lora_stack.url, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert (status, first.model) == (202, "sql") and "requests still run under it" in text
    assert "sql" in {m.id for m in client.models.list().data}
    assert sum(1 for chunk in stream if chunk.choices) > 0  # the running request finishes under it
    poll(lambda: "sql" not in {m.id for m in client.models.list().data}, 15, "the worker to unload the adapter")


def test_loading_an_adapter_where_no_worker_has_lora_on_is_a_400_at_once(stack):
    """Found by schemathesis: the registry was written, no worker ever loaded it, and the answer was a
    504 after 30 s with the entry left behind."""
    status, text = post(stack.url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"})
    assert status == 400 and "--enable-lora" in text  # refused at once: the wait for a worker ends in a 504
    assert redis.Redis.from_url(stack.redis.url).hlen(Keys().adapters(MODEL_NAME)) == 0
