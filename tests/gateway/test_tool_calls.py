"""Tool calling through the gateway with the OpenAI SDK, on a random-weight model: forced calls
(``required``, a named function) are always well-formed; streamed calls reassemble to the
non-streamed answer; the parsers find calls in text split anywhere."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pagedserve.gateway.answers.tool_calls import ToolRequest, ToolStream, extract
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


def tool_request(body: dict) -> ToolRequest | None:
    """What a chat body's tool fields come to, through the gateway's own parse."""
    from pagedserve.gateway.bodies.parse import Limits, parse

    return parse({"model": MODEL_NAME, "messages": ASK, **body}, True, Limits()).tools


@pytest.mark.parametrize("body, param, says", [
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "evict"}}}, "tool_choice", "tool_choice needs tools"),
    ({"tools": {"not": "a list"}}, "tools", "tools: Input should be a valid list"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools",
     "tools: List should have at most 128 items"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools", "tools[0].type: Input should be 'function'"),
    ({"tools": [*TOOLS, {"type": "function", "function": {"name": ""}}]}, "tools",
     "tools[2].function.name: String should have at least 1 character"),
    ({"tools": [{"type": "function", "function": {"name": 3}}]}, "tools", "tools[0].function.name: Input should be a valid string"),
    ({"tools": ["get_weather"]}, "tools", "tools[0]: Input should be a valid dictionary"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools",
     "tools[0].function.parameters: Input should be a valid dictionary"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "tool names must be unique"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "parallel_tool_calls: Input should be a valid boolean"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     'tool_choice must be "none", "auto", "required" or a function among the tools; got \'nope\''),
    ({"tools": TOOLS, "tool_choice": {"type": "other", "function": {"name": "evict"}}}, "tool_choice", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "tool_choice.function: Field required"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "x" * 200}, "tool_choice", "tool_choice"),
])
def test_tool_requests_that_cannot_be_served_name_their_field(body, param, says):
    from pagedserve.gateway.bodies.parse import ApiError

    with pytest.raises(ApiError) as err:
        tool_request(body)
    assert err.value.param == param and err.value.message.startswith(says), err.value.message
    assert len(err.value.message) < 300  # what came is cut, never echoed whole


def test_tool_requests_read_as_given():
    assert tool_request({}) is None and tool_request({"tools": [], "tool_choice": "none"}) is None
    assert tool_request({"tool_choice": "auto"}) is None
    assert tool_request({"tools": TOOLS}) == ToolRequest(tuple(TOOLS), "auto", None, True)
    assert tool_request({"tools": TOOLS, "tool_choice": "auto"}) == ToolRequest(tuple(TOOLS), "auto", None, True)
    most = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(128)]
    assert len(tool_request({"tools": most}).tools) == 128
    assert tool_request({"tools": TOOLS, "tool_choice": "none"}).parses_output is False
    assert tool_request({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}) == \
        ToolRequest(tuple(TOOLS), "required", None, False)
    named = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "evict"}}, "parallel_tool_calls": True}
    assert tool_request(named) == ToolRequest(tuple(TOOLS), "named", "evict", True)
    assert tool_request({**named, "parallel_tool_calls": False}) == ToolRequest(tuple(TOOLS), "named", "evict", False)


def test_assistant_tool_calls_reach_the_template_with_their_arguments_as_objects():
    from pagedserve.gateway.answers.tool_calls import template_messages

    call = {"id": "call_1", "type": "function", "function": {"name": "evict", "arguments": '{"block": 7}'}}
    odd = {"id": "call_2", "type": "function", "function": {"name": "evict", "arguments": "not json"}}
    given = {"id": "call_3", "type": "function", "function": {"name": "evict", "arguments": {"block": 1}}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call, odd, given]},
                {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    out = template_messages(messages)
    assert out[0] == messages[0] and out[2] == messages[2]
    assert [c["function"]["arguments"] for c in out[1]["tool_calls"]] == [{"block": 7}, "not json", {"block": 1}]
    assert out[1]["tool_calls"][0] == {**call, "function": {"name": "evict", "arguments": {"block": 7}}}
    assert call["function"]["arguments"] == '{"block": 7}'  # the request's own messages are left as they were


def test_a_forced_call_is_constrained_to_the_tools_schemas():
    def schema(request: ToolRequest) -> dict:
        return json.loads(request.constraint().json)

    bare = {"type": "function", "function": {"name": "ping"}}  # no parameters: any object
    assert schema(ToolRequest(tuple(TOOLS), "named", "evict")) == EVICT
    assert schema(ToolRequest((bare,), "named", "ping")) == {"type": "object"}
    array = schema(ToolRequest(tuple(TOOLS), "required"))
    assert array["type"] == "array" and array["minItems"] == 1 and "maxItems" not in array
    assert [c["properties"]["name"] for c in array["items"]["anyOf"]] == [{"const": "get_weather"}, {"const": "evict"}]
    assert array["items"]["anyOf"][1] == {"type": "object", "properties": {"name": {"const": "evict"}, "parameters": EVICT},
                                          "required": ["name", "parameters"], "additionalProperties": False}
    assert schema(ToolRequest(tuple(TOOLS), "required", parallel=False))["maxItems"] == 1
    assert ToolRequest(tuple(TOOLS), "auto").constraint() is None and ToolRequest(tuple(TOOLS), "none").constraint() is None


def test_calls_come_out_whole_from_each_format():
    import re

    named = extract('{"block": 2}', ToolRequest(tuple(TOOLS), "named", "evict"), "hermes")
    assert named[0] is None and named[1][0]["function"] == {"name": "evict", "arguments": '{"block": 2}'}
    call = named[1][0]
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"]) and call["type"] == "function"
    required = ToolRequest(tuple(TOOLS), "required")
    content, calls = extract('[{"name": "get_weather", "parameters": {"city": "Zürich", "days": 2}}]', required, "hermes")
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Zürich", "days": 2}'}
    assert extract('[{"name": "get_weather", "param', required, "hermes") == (None, [])
    content, calls = extract('<tool_call>{"name": "evict"}</tool_call>', AUTO, "hermes")  # a call at the very start
    assert content is None and calls[0]["function"] == {"name": "evict", "arguments": "{}"}
    assert extract('<tool_call>{"name": "evict"}</tool_call> and more', AUTO, "hermes")[1] == []
    assert extract('<tool_call>{"name": "evict"}', AUTO, "hermes")[1] == []
    assert extract('{"name": "evict", "arguments": {"block": 4}}', AUTO, "llama3_json")[1][0]["function"]["arguments"] == \
        '{"block": 4}'
    assert extract('{"name": "evict"}', AUTO, "llama3_json")[1][0]["function"]["arguments"] == "{}"
    assert extract('<|python_tag|>{"name": "evict", "parameters": {"block": 2}}', AUTO, "llama3_json")[1][0]["function"] == \
        {"name": "evict", "arguments": '{"block": 2}'}


@pytest.mark.parametrize("cut", range(1, 40))
def test_a_call_at_the_start_of_the_answer_is_never_streamed_as_content(cut):
    text = '<tool_call>{"name": "evict", "arguments": {"block": 7}}</tool_call>'
    stream = ToolStream(AUTO, "hermes")
    assert stream.feed(text[:cut], False)[0] == ""
    last, calls = stream.feed(text[cut:], True)
    assert last == "" and [c["function"]["name"] for c in calls] == ["evict"]


def test_llama3_json_holds_everything_until_the_end_and_forced_calls_stream_no_content():
    stream = ToolStream(AUTO, "llama3_json")
    assert [stream.feed(piece, False)[0] for piece in ("Just ", "words")] == ["", ""]
    assert stream.feed("", True) == ("Just words", [])
    for request in (ToolRequest(tuple(TOOLS), "required"), ToolRequest(tuple(TOOLS), "named", "evict")):
        forced = ToolStream(request, "hermes")
        assert forced.feed('[{"name": "evict", ', False) == ("", [])
        sent, calls = forced.feed('"parameters": {"block": 1}}]' if request.choice == "required" else "", True)
        assert sent == "" and calls and calls[0]["function"]["name"] == "evict"
    cut = ToolStream(ToolRequest(tuple(TOOLS), "required"), "hermes")
    assert cut.feed('[{"name": "ev', False) == ("", []) and cut.feed("", True) == ("", [])
    plain = ToolStream(AUTO, "hermes")
    assert plain.feed("a <", False)[0] == "a " and plain.feed(" b", False)[0] == "< b"


def test_a_required_answer_cut_short_returns_its_calls_as_far_as_they_came():
    """As the OpenAI API does for a call cut by max_tokens: the whole calls, then the one being
    written, its arguments not yet valid JSON (finish_reason stays "length")."""
    required = ToolRequest(tuple(TOOLS), "required")
    whole = '{"name": "evict", "parameters": {"block": 3}}'
    content, calls = extract(f'[{whole}, {{"name": "get_weather", "parameters": {{"city": "Par', required, "hermes")
    assert content is None
    assert [c["function"] for c in calls] == [{"name": "evict", "arguments": '{"block": 3}'},
                                              {"name": "get_weather", "arguments": '{"city": "Par'}]
    assert [c["function"]["name"] for c in extract(f"[{whole},\n {whole}]", required, "hermes")[1]] == ["evict", "evict"]
    assert extract(f'[{whole}, {{"na', required, "hermes")[1][0]["function"]["name"] == "evict"
    assert extract('[{"name": "get_wea', required, "hermes") == (None, [])
    assert extract(f"[{whole}, ", required, "hermes")[1][0]["function"]["name"] == "evict"  # cut between calls
    nested = extract('[{"name": "f", "parameters": {"xs": [1, 2]}}]', required, "hermes")[1]
    assert [c["function"] for c in nested] == [{"name": "f", "arguments": '{"xs": [1, 2]}'}]
    assert extract(whole, required, "hermes") == (None, [])  # not the array the grammar writes
    assert extract("", required, "hermes") == (None, [])


def test_a_required_call_cut_by_max_tokens_says_length_and_carries_the_call(client):
    """Through the gateway, at budgets that cut the answer at different points: finish_reason
    "length", no content, and the calls as far as they came (a cut one's arguments unfinished)."""
    cut = 0
    for max_tokens in (8, 16, 24, 32):
        choice = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                                max_tokens=max_tokens, temperature=1.0, seed=5).choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None, (max_tokens, choice.message)
        for call in choice.message.tool_calls or []:
            assert call.function.name in SCHEMAS and call.id.startswith("call_")
            try:
                json.loads(call.function.arguments)
            except ValueError:
                cut += 1
    assert cut, "no budget cut a call inside its arguments"
