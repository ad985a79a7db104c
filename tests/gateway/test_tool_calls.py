"""Tool calling through the gateway with the OpenAI SDK, on a random-weight model: forced calls
(``required``, a named function) are always well-formed; streamed calls reassemble to the
non-streamed answer; the parsers find calls in text split anywhere."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pagedserve.gateway.tool_calls import ToolRequest, ToolStream, extract
from tests.service_helpers import MODEL_NAME

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
EVICT = {"type": "object", "properties": {"block": {"type": "integer", "minimum": 0, "maximum": 1023}},
         "required": ["block"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "evict", "parameters": EVICT}}]
SCHEMAS = {"get_weather": WEATHER, "evict": EVICT}
ASK = [{"role": "user", "content": "weather in Paris for 3 days?"}]


def check_calls(calls) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_always_yields_well_formed_tool_calls(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required", n=8,
                                       max_tokens=120, temperature=1.0, seed=1, parallel_tool_calls=False)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        assert len(choice.message.tool_calls) == 1  # parallel_tool_calls=False: one call
        check_calls(choice.message.tool_calls)
    assert len({c.message.tool_calls[0].id for c in r.choices}) == 8


def test_a_named_function_is_the_one_called(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, n=8, max_tokens=80, temperature=1.0,
                                       seed=2, tool_choice={"type": "function", "function": {"name": "evict"}})
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [c.function.name for c in choice.message.tool_calls] == ["evict"]
        check_calls(choice.message.tool_calls)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_reassemble_to_the_non_streamed_answer(client, tool_choice):
    kwargs = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=120, temperature=1.0, seed=7,
                  parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls, reasons = {}, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for part in choice.delta.tool_calls or []:
                entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
                entry["name"] += part.function.name or ""
                entry["arguments"] += part.function.arguments or ""
    assert [reason for reason in reasons if reason] == [whole.finish_reason] == ["tool_calls"]
    assert [calls[i] for i in sorted(calls)] == [{"name": c.function.name, "arguments": c.function.arguments}
                                                 for c in whole.message.tool_calls]


def test_the_template_sees_the_tools_and_the_next_turn_takes_tool_messages(client):
    plain = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=1)
    first = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, temperature=1.0, seed=3, parallel_tool_calls=False)
    assert first.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the tools' schemas are in the prompt
    call = first.choices[0].message.tool_calls[0]
    follow = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model=MODEL_NAME, messages=follow, tools=TOOLS, max_tokens=4)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize("extra, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], "tool_choice": "required"},
     "tools"),  # a forced call needs a grammar from the parameters: a schema it cannot follow is the client's 400
])
def test_bad_tool_requests_are_400s_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=4, extra_body=extra)
    assert err.value.body["param"] == param, err.value.body


def test_a_tool_message_without_its_call_id_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_NAME, max_tokens=4, messages=[*ASK, {"role": "tool", "content": "x"}])
    assert err.value.body["param"] == "messages[1]"


AUTO = ToolRequest(tuple(TOOLS), "auto")
HERMES_TEXT = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>' \
              '\n<tool_call>{"name": "evict", "arguments": {"block": 7}}</tool_call>'


def test_hermes_calls_after_text_are_found():
    content, calls = extract(HERMES_TEXT, AUTO, "hermes")
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["get_weather", "evict"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert extract("no call here <tool_", AUTO, "hermes") == ("no call here <tool_", [])
    assert extract('<tool_call>{"name": broken</tool_call>', AUTO, "hermes")[1] == []


def test_llama3_json_calls_are_found():
    content, calls = extract('<|python_tag|>{"name": "evict", "parameters": {"block": 2}}', AUTO, "llama3_json")
    assert content is None and calls[0]["function"]["name"] == "evict"
    assert extract("just words", AUTO, "llama3_json") == ("just words", [])


@pytest.mark.parametrize("cut", range(0, len(HERMES_TEXT), 3))
def test_streamed_content_never_leaks_a_call_whatever_the_split(cut):
    stream = ToolStream(AUTO, "hermes")
    sent = stream.feed(HERMES_TEXT[:cut], False)[0]
    last, calls = stream.feed(HERMES_TEXT[cut:], True)
    assert (sent + last).strip() == "Let me check." and len(calls) == 2
    plain = ToolStream(AUTO, "hermes")
    words = "no tools < here"
    assert plain.feed(words[:cut % len(words)], False)[0] + plain.feed(words[cut % len(words):], True)[0] == words


@pytest.mark.parametrize("text", ["no tools < here", "ends on a held <", "ends on <tool_", "a <b> and <tool_cal",
                                  "<tool_call> never closed"])
def test_text_held_back_as_a_possible_call_goes_out_when_none_came(text):
    """Content with no call, streamed split at every point and one character at a time: whatever
    was held back because it might start a call (a ``<``, a marker's beginning) is sent at the end."""
    for cut in range(len(text) + 1):
        stream = ToolStream(AUTO, "hermes")
        sent = stream.feed(text[:cut], False)[0]
        last, calls = stream.feed(text[cut:], True)
        assert (sent + last, calls) == (text, []), cut
    stream = ToolStream(AUTO, "hermes")
    pieces = [stream.feed(ch, False)[0] for ch in text]
    assert "".join(pieces) + stream.feed("", True)[0] == text


def test_streamed_auto_content_is_the_non_streamed_answer(client):
    """``tool_choice: "auto"`` streamed through the gateway: the content deltas add up to the
    non-streamed message's content (the model, random, answers in text), with the same finish."""
    kwargs = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=40, temperature=1.0)
    for seed in range(3):
        whole = client.chat.completions.create(seed=seed, **kwargs).choices[0]
        content, reasons = "", []
        for chunk in client.chat.completions.create(stream=True, seed=seed, **kwargs):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                reasons.append(choice.finish_reason)
        assert content == (whole.message.content or ""), seed
        assert [r for r in reasons if r] == [whole.finish_reason]
