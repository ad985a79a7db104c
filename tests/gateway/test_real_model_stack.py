"""A GGUF file through the whole stack (gateway, Redis, worker) with the OpenAI SDK: SmolLM2's real
vocabulary and chat template in the gateway's tokenizer, streamed text across multi-byte
characters, a JSON schema answered right, and a tool call parsed with arguments that validate."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedserve.stack import LocalStack

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
