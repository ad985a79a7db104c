"""A GGUF file through the whole stack (gateway, Redis, worker) with the OpenAI SDK: SmolLM2's real
vocabulary and chat template in the gateway's tokenizer, streamed text across multi-byte
characters, a JSON schema answered right, and a tool call parsed with arguments that validate."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedserve.stack import LocalStack
from pagedserve.worker.offline_outputs import prompt_token_logprobs

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(real_model):
    from openai import OpenAI

    # the 8-bit cache through the stack too: the answers below hold on it
    with LocalStack(model=str(real_model.gguf), extra_worker_args=("--num-gpu-blocks", "512", "--kv-cache-dtype", "int8")) \
            as stack:
        yield OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0), stack.served_model_name


def chat(client, content: str, **fields):
    sdk, model = client
    return sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], temperature=0,
                                       max_tokens=fields.pop("max_tokens", 32), **fields)


def test_the_model_is_listed_under_the_name_it_was_served_as(client, real_model):
    sdk, model = client
    (card,) = sdk.models.list().data
    assert model == str(real_model.gguf) and card.id == model
    assert card.model_extra["max_model_len"] == 8192 and card.model_extra["kv_cache_dtype"] == "int8"


@pytest.mark.parametrize("question", ["What is the capital of France?", "用中文介绍一下北京。"])
def test_streamed_text_is_the_whole_answer(client, question):
    whole = chat(client, question).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chat(client, question, stream=True)
                       if chunk.choices)
    assert streamed == whole and "\ufffd" not in whole
    if "France" in question:
        assert "Paris" in whole


def test_a_json_schema_answer_is_valid_and_right(client):
    schema = {"type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
              "required": ["country", "capital"], "additionalProperties": False}
    out = chat(client, "What is the capital of France? Answer in JSON with the keys country and capital.", max_tokens=48,
               response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}})
    value = json.loads(out.choices[0].message.content)
    jsonschema.validate(value, schema)
    assert value["capital"] == "Paris"


def test_a_tool_call_comes_back_parsed_with_arguments_that_validate(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                               "parameters": WEATHER}}]
    out = chat(client, "What is the weather like in Paris today, in celsius?", max_tokens=48, tools=tools,
               tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason in ("tool_calls", "stop") and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert "Paris" in arguments["city"]


def test_echo_with_logprobs_scores_the_prompt_as_the_engine_does(client, real_model):
    """lm-evaluation-harness's loglikelihood request: echo + logprobs; the prompt's tokens come back
    with the logprobs the offline engine gives them with the same settings (an int8 cache)."""
    import httpx

    from pagedserve import LLM
    from pagedserve.shared.sampling import SamplingParams

    sdk, model = client
    text = "The capital of France is Paris, and the capital of Italy is Rome."
    body = {"model": model, "prompt": text, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    r = httpx.post(str(sdk.base_url).rstrip("/") + "/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"].startswith(text)
    lp = choice["logprobs"]
    ids = real_model.tokenizer.encode(text, add_special_tokens=False)
    assert len(lp["tokens"]) == len(ids) + 1 and "".join(lp["tokens"][: len(ids)]) == text
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    offline = LLM(real_model.gguf, device="cpu", kv_cache_dtype="int8", num_gpu_blocks=64)  # the worker's defaults
    expected = prompt_token_logprobs(offline.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                                                      use_tqdm=False)[0])
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1 : len(ids)], expected)) < 1e-4
    assert all(len(top) in (1, 2) for top in lp["top_logprobs"][1:])
    plain = httpx.post(str(sdk.base_url).rstrip("/") + "/completions", json={**body, "logprobs": None}, timeout=120).json()
    assert plain["choices"][0]["text"] == choice["text"] and plain["choices"][0]["logprobs"] is None
