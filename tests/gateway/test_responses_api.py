"""``/v1/responses`` with the official ``openai`` SDK, unchanged, against a live stack: the answer is
the chat completion's (same template, sampling and seed), streamed events reassemble to it, stored
answers are retrieved, continued and deleted, a tool round trip, ``text.format``, bad requests."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.service_helpers import MODEL_NAME

CITY = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"}}, "required": ["city"],
        "additionalProperties": False}
TOOL = {"type": "function", "name": "weather", "description": "forecast for a city", "parameters": CITY}
SEEDED = {"top_k": 40}


STATUS = {"length": "incomplete", "stop": "completed"}  # the chat's finish_reason -> the response's status


def chat_choice(client, messages: list[dict], max_tokens: int, seed: int):
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens, seed=seed,
                                          temperature=1.0, extra_body=SEEDED).choices[0]


def chat_text(client, messages: list[dict], max_tokens: int, seed: int) -> str:
    return chat_choice(client, messages, max_tokens, seed).message.content


def test_a_response_is_the_chat_completion_of_the_same_conversation(client):
    made = client.responses.create(model=MODEL_NAME, input="pages?", instructions="be brief", max_output_tokens=12,
                                   temperature=1.0, extra_body={"seed": 4, **SEEDED})
    assert made.object == "response" and made.id.startswith("resp_")
    for max_tokens in (12, 2):  # cut by max_output_tokens or not, each status as the chat's finish says
        made = client.responses.create(model=MODEL_NAME, input="pages?", instructions="be brief",
                                       max_output_tokens=max_tokens, temperature=1.0, extra_body={"seed": 4, **SEEDED})
        chat = chat_choice(client, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "pages?"}],
                           max_tokens, seed=4)
        assert made.output_text == chat.message.content and made.status == STATUS[chat.finish_reason]
        assert made.usage.output_tokens <= max_tokens
        assert made.usage.total_tokens == made.usage.input_tokens + made.usage.output_tokens
        reason = made.incomplete_details.reason if made.incomplete_details else None
        assert reason == {"incomplete": "max_output_tokens", "completed": None}[made.status]
    assert made.status == "incomplete"  # two tokens: cut


def test_streamed_events_reassemble_to_the_response(client):
    ask = dict(model=MODEL_NAME, input=[{"role": "user", "content": [{"type": "input_text", "text": "blocks?"}]}],
               max_output_tokens=16, temperature=1.0, extra_body={"seed": 6, **SEEDED})
    whole = client.responses.create(**ask)
    with client.responses.stream(**ask) as stream:
        events = list(stream)
    final = events[-1].response  # response.completed, or response.incomplete when cut by max_output_tokens
    assert events[-1].type == f"response.{whole.status}" and final.status == whole.status
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text == final.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert client.responses.retrieve(final.id).output_text == final.output_text  # stored when streamed too


def test_a_stored_response_is_retrieved_continued_and_deleted(client):
    first = client.responses.create(model=MODEL_NAME, input="count pages", max_output_tokens=8, temperature=1.0,
                                    extra_body={"seed": 1, **SEEDED})
    got = client.responses.retrieve(first.id)
    assert (got.id, got.output_text, got.usage.output_tokens) == (first.id, first.output_text, first.usage.output_tokens)
    second = client.responses.create(model=MODEL_NAME, input="and blocks?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=1.0, extra_body={"seed": 2, **SEEDED})
    assert second.previous_response_id == first.id
    assert second.output_text == chat_text(client, [{"role": "user", "content": "count pages"},
                                                    {"role": "assistant", "content": first.output_text},
                                                    {"role": "user", "content": "and blocks?"}], 8, seed=2)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as err:  # nothing left to continue
        client.responses.create(model=MODEL_NAME, input="more", previous_response_id=first.id, max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id"


def test_unknown_ids_are_404s_and_a_deletion_answers_what_it_deleted(stack, client):
    for method in ("GET", "DELETE"):
        r = httpx.request(method, stack.url + "/v1/responses/resp_nothing", timeout=60)
        assert r.status_code == 404 and r.json() == {"error": {
            "message": "no stored response 'resp_nothing'", "type": "invalid_request_error", "param": "response_id",
            "code": "not_found"}}, (method, r.text)
    made = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2)
    r = httpx.delete(stack.url + f"/v1/responses/{made.id}", timeout=60)
    assert r.status_code == 200 and r.json() == {"id": made.id, "object": "response", "deleted": True}
    r = httpx.post(stack.url + "/v1/responses", json={"model": MODEL_NAME, "input": "more", "previous_response_id": made.id},
                   timeout=60)
    assert r.status_code == 400 and r.json() == {"error": {
        "message": f"no stored response {made.id!r} (never stored, deleted, or expired)", "type": "invalid_request_error",
        "param": "previous_response_id", "code": "previous_response_not_found"}}


def test_a_stored_response_expires_after_the_gateways_ttl(stack, client):
    from pagedserve.gateway.service.generation import STATE

    state = stack.runners[0].app[STATE]
    made = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2)
    ttl = stack.run(state.redis.ttl(state.keys.stored_response(made.id)))
    assert 0 < ttl <= state.settings.responses_ttl_s and ttl >= state.settings.responses_ttl_s - 60


def test_a_streams_first_events_say_in_progress_and_the_last_carries_the_cached_tokens(stack, client):
    ask = dict(model=MODEL_NAME, input="a block table maps a sequence to its blocks " * 6, max_output_tokens=3)
    client.responses.create(**ask)  # its blocks now cached
    with client.responses.stream(**ask) as stream:
        events = list(stream)
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == events[1].response.status == "in_progress" and events[1].response.output == []
    final = events[-1].response
    assert final.usage.input_tokens_details.cached_tokens >= 16 and final.output_text
    assert final.output == client.responses.retrieve(final.id).output


def test_store_false_keeps_nothing(client):
    made = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2, store=False)
    assert made.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)


@pytest.mark.parametrize("streamed", [False, True])
def test_a_function_call_round_trip(client, streamed):
    ask = dict(model=MODEL_NAME, input="weather in paris?", tools=[TOOL], tool_choice={"type": "function", "name": "weather"},
               max_output_tokens=40, temperature=1.0, extra_body={"seed": 3, **SEEDED})
    if streamed:
        with client.responses.stream(**ask) as stream:
            argument_deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
            first = stream.get_final_response()
    else:
        first = client.responses.create(**ask)
    call = next(item for item in first.output if item.type == "function_call")
    assert call.name == "weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), CITY)
    if streamed:
        assert "".join(argument_deltas) == call.arguments
    def answered(output: str):
        return client.responses.create(model=MODEL_NAME, previous_response_id=first.id, max_output_tokens=4, tools=[TOOL],
                                       input=[{"type": "function_call_output", "call_id": call.call_id, "output": output}])

    second, longer = answered("sunny"), answered("sunny, then rain from the west by evening")
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its output reached the template
    assert longer.usage.input_tokens > second.usage.input_tokens  # the output's own text did, not just its turn
    assert first.status == "completed" and second.status == "incomplete"  # a call ends it; 4 tokens cut the second
    whole = client.responses.create(model=MODEL_NAME, max_output_tokens=4, tools=[TOOL], input=[
        {"role": "user", "content": "weather in paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert whole.usage.input_tokens == second.usage.input_tokens  # the call sent as an input item: the same prompt


def test_text_format_json_schema_constrains_the_answer(client):
    made = client.responses.create(model=MODEL_NAME, input="a city", max_output_tokens=40, temperature=1.0,
                                   text={"format": {"type": "json_schema", "name": "city", "schema": CITY}},
                                   extra_body={"seed": 8})
    jsonschema.validate(json.loads(made.output_text), CITY)
    assert made.status == "completed" and made.incomplete_details is None  # the grammar ended it


def test_text_format_json_object_answers_a_json_object(client):
    made = client.responses.create(model=MODEL_NAME, input="an object", max_output_tokens=64, temperature=1.0,
                                   text={"format": {"type": "json_object"}}, extra_body={"seed": 8})
    assert made.text.format.type == "json_object"
    # random weights write one long key: cut inside the object (seeded), which the grammar opened
    assert made.status == "incomplete" and made.incomplete_details.reason == "max_output_tokens"
    assert made.output_text.startswith('{"') and made.usage.output_tokens == 64


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": ""}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": "hi", "tools": [{"type": "function", "name": ""}]}, "tools"),
])
def test_bad_requests_are_400s_naming_the_field(stack, body, param):
    r = httpx.post(stack.url + "/v1/responses", json={"model": MODEL_NAME, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("streamed", [False, True])
def test_a_store_that_fails_is_a_clear_error_not_a_broken_stream(stack, client, monkeypatch, streamed):
    from redis.exceptions import ConnectionError as RedisConnectionError

    from pagedserve.gateway.service.generation import STATE

    state = stack.runners[0].app[STATE]

    async def unreachable(*args, **kwargs):
        raise RedisConnectionError("Redis went away")

    monkeypatch.setattr(state.redis, "set", unreachable)
    body = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 3, "stream": streamed}
    r = httpx.post(stack.url + "/v1/responses", json=body, timeout=60)
    if streamed:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        message = events[-1]["message"]
        assert r.status_code == 200 and events[-1] == {"type": "error", "code": "store_failed", "message": message,
                                                       "param": None, "sequence_number": len(events) - 1}
        assert any(e["type"] == "response.output_item.done" for e in events)  # the text came before
    else:
        message = r.json()["error"]["message"]
        assert r.status_code == 503 and r.json()["error"] == {"message": message, "type": "service_unavailable",
                                                              "param": None, "code": "store_failed"}, r.text
    assert re.fullmatch(r"the response resp_\w+ was made but could not be stored \(ConnectionError\); "
                        r"send it again, or with store: false", message), message
    monkeypatch.undo()
    assert client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2).status in ("completed", "incomplete")
