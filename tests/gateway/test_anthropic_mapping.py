"""The Messages API's mapping on its own (``gateway/routes/anthropic.py``), no stack: a request as the
chat body it amounts to, each turn's blocks as chat messages, a worker's deltas as the message
(blocks, stop reason, the matched stop sequence, usage with the cached tokens apart), a tool call as a
``tool_use`` block, the stream's block events, errors in Anthropic's shape. Every expected object is
written out whole, so the mapping tables are pinned here (the live tests in test_anthropic_api.py
check the same API through a real gateway and worker)."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedserve.gateway.bodies.anthropic import MessagesRequest
from pagedserve.gateway.bodies.parse import Limits, parse
from pagedserve.gateway.http.api_error import ApiError
from pagedserve.gateway.routes.anthropic import Blocks, Reply, chat_body, error_body, tool_use
from pagedserve.shared.protocol import OutputDelta

WEATHER = {"name": "weather", "description": "the weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
WEATHER_FUNCTION = {"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                                     "parameters": WEATHER["input_schema"]}}


def request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 16,
                                           "messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize("status,kind", [(400, "invalid_request_error"), (401, "authentication_error"),
                                         (403, "permission_error"), (404, "not_found_error"),
                                         (413, "request_too_large"), (429, "rate_limit_error"),
                                         (503, "overloaded_error"), (502, "api_error")])
def test_errors_are_in_anthropics_shape(status, kind):
    assert error_body(ApiError(status, "what went wrong")) == {
        "type": "error", "error": {"type": kind, "message": "what went wrong"}}


def test_a_request_is_the_chat_body_it_amounts_to():
    req = request(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
                  stop_sequences=["END"], temperature=0.5, top_p=0.9, top_k=40, stream=True, priority=-2, seed=7,
                  metadata={"user_id": "tenant-a"}, tools=[WEATHER], tool_choice={"type": "auto"})
    assert chat_body(req) == {
        "model": "m", "messages": [{"role": "system", "content": "Be brief.\nBe kind."}, {"role": "user", "content": "hi"}],
        "max_tokens": 16, "stream": True, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "stop": ["END"],
        "priority": -2, "seed": 7, "user": "tenant-a", "tools": [WEATHER_FUNCTION], "tool_choice": "auto"}
    assert chat_body(request()) == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    no_description = chat_body(request(tools=[{**WEATHER, "description": None}]))["tools"][0]["function"]
    assert no_description["description"] == ""


@pytest.mark.parametrize("choice,expected", [
    ({"type": "auto"}, {"tool_choice": "auto"}),
    ({"type": "any"}, {"tool_choice": "required"}),
    ({"type": "none"}, {"tool_choice": "none"}),
    ({"type": "tool", "name": "weather"}, {"tool_choice": {"type": "function", "function": {"name": "weather"}}}),
    ({"type": "any", "disable_parallel_tool_use": True}, {"tool_choice": "required", "parallel_tool_calls": False}),
    ({"type": "auto", "disable_parallel_tool_use": False}, {"tool_choice": "auto"}),
])
def test_tool_choice_maps_to_the_chats(choice, expected):
    body = chat_body(request(tools=[WEATHER], tool_choice=choice))
    assert {k: body[k] for k in ("tool_choice", "parallel_tool_calls") if k in body} == expected


def test_a_tool_choice_of_a_tool_without_its_name_is_refused():
    with pytest.raises(ApiError) as caught:
        chat_body(request(tools=[WEATHER], tool_choice={"type": "tool"}))
    assert caught.value.status == 400 and caught.value.param == "tool_choice"
    assert caught.value.message == 'tool_choice of type "tool" needs the tool\'s name'


def test_each_turns_blocks_become_chat_messages():
    """An assistant's text and calls are one message (its thinking left out); a user's tool results
    come first, one tool message each, then its text; a user turn of results only has no user message."""
    messages = chat_body(request(messages=[
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}, {"type": "text", "text": "And Rome?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call the tool.", "signature": ""},
            {"type": "redacted_thinking", "data": "xyz"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "21"},
                                                                           {"type": "text", "text": "C"}]},
            {"type": "text", "text": "Thanks."}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_3", "name": "weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3", "is_error": True}]},
        {"role": "assistant", "content": [{"type": "text", "text": "It"}, {"type": "text", "text": "rains."}]},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "Done."},
    ]))["messages"]
    call = lambda id_, args: {"id": id_, "type": "function",  # noqa: E731
                              "function": {"name": "weather", "arguments": json.dumps(args)}}
    assert messages == [
        {"role": "user", "content": "Weather in Paris?\nAnd Rome?"},
        {"role": "assistant", "content": "Let me look.",
         "tool_calls": [call("toolu_1", {"city": "Paris"}), call("toolu_2", {"city": "Rome"})]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "21\nC"},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "", "tool_calls": [call("toolu_3", {})]},
        {"role": "tool", "tool_call_id": "toolu_3", "content": ""},
        {"role": "assistant", "content": "It\nrains."},  # no calls: no tool_calls
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "Done."},
    ]


@pytest.mark.parametrize("block", [{"type": "tool_use", "id": "t", "name": "weather", "input": {}},
                                   {"type": "thinking", "thinking": "hm"},
                                   {"type": "redacted_thinking", "data": "xyz"}])
def test_a_users_turn_with_an_assistants_blocks_is_refused(block):
    with pytest.raises(ApiError) as caught:
        chat_body(request(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, block]}]))
    assert caught.value.status == 400 and caught.value.param == "messages"
    assert caught.value.message == "tool_use and thinking blocks belong to the assistant's turns"


def reply(tools: bool = False, reasoning_parser: str | None = None, **fields) -> Reply:
    body = chat_body(request(tools=[WEATHER] if tools else None, **fields))
    return Reply(parse(body, True, Limits()), "msg_1", "hermes", reasoning_parser)


def deltas(*pieces: tuple[str, int], finish: str = "stop", stop: str | int | None = None) -> list[OutputDelta]:
    out = [OutputDelta(0, list(range(tokens)), text) for text, tokens in pieces]
    last = out[-1]
    out[-1] = OutputDelta(0, last.token_ids, last.text, finish, None, stop)
    return out


def test_a_replies_deltas_become_the_message_with_usage_and_cached_tokens_apart():
    got = reply()
    for delta in deltas(("Hello", 2), (" there.", 3)):
        got.add(delta)
    assert got.message(40, 32) == {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
        "content": [{"type": "text", "text": "Hello there."}], "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": 8, "cache_read_input_tokens": 32, "cache_creation_input_tokens": 0, "output_tokens": 5}}
    assert got.head(40) == {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
                            "stop_reason": None, "stop_sequence": None,
                            "usage": {"input_tokens": 40, "output_tokens": 0}}
    assert got.message(40)["usage"]["input_tokens"] == 40  # nothing read from the cache


@pytest.mark.parametrize("finish,stop,reason,sequence", [
    ("length", None, "max_tokens", None),
    ("stop", None, "end_turn", None),  # the end-of-sequence token
    ("stop", 2, "end_turn", None),  # a stop token id: not a stop sequence
    ("stop", "END", "stop_sequence", "END"),
    ("abort", None, "end_turn", None),
    ("length", "END", "max_tokens", None),  # cut by max_tokens, whatever else was said
])
def test_how_a_reply_ended_is_its_stop_reason(finish, stop, reason, sequence):
    got = reply()
    for delta in deltas(("text", 1), finish=finish, stop=stop):
        got.add(delta)
    message = got.message(3)
    assert (message["stop_reason"], message["stop_sequence"]) == (reason, sequence)


def test_a_call_in_the_reply_is_a_tool_use_block_and_its_stop_reason():
    got = reply(tools=True)
    text = 'Checking.<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
    for delta in deltas((text, 9)):
        got.add(delta)
    message = got.message(10)
    text_block, call = message["content"]
    assert text_block == {"type": "text", "text": "Checking."}
    assert call["id"].startswith("toolu_") and len(call["id"]) == len("toolu_") + 24
    assert {k: v for k, v in call.items() if k != "id"} == {"type": "tool_use", "name": "weather",
                                                            "input": {"city": "Paris"}}
    assert message["stop_reason"] == "tool_use"
    cut = reply(tools=True)
    for delta in deltas((text, 9), finish="length"):
        cut.add(delta)
    assert cut.message(10)["stop_reason"] == "max_tokens"  # a call cut short is not a finished call


def test_thinking_comes_first_as_its_own_block():
    got = reply(reasoning_parser="deepseek_r1")
    for delta in deltas(("<think>Two and two.</think>", 6), ("Four.", 2)):
        got.add(delta)
    assert got.message(5)["content"] == [{"type": "thinking", "thinking": "Two and two.", "signature": ""},
                                         {"type": "text", "text": "Four."}]
    empty = reply()
    empty.add(deltas(("", 0))[0])
    assert empty.message(5)["content"] == []


@pytest.mark.parametrize("arguments,expected", [
    ('{"city": "Paris"}', {"city": "Paris"}),
    ("", {}),
    ('{"city": "Pa', {"_partial": '{"city": "Pa'}),  # cut by max_tokens: what came, as a string
    ("[1, 2]", {"value": [1, 2]}),
    ("3", {"value": 3}),
])
def test_a_tool_call_is_a_tool_use_block(arguments, expected):
    block = tool_use({"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": arguments}})
    assert block["input"] == expected and block["name"] == "weather" and block["type"] == "tool_use"
    assert set(block) == {"type", "id", "name", "input"}


class Written:
    """A stream response that keeps what is written (the SSE frames), as events."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    async def write(self, frame: bytes) -> None:
        lines = frame.decode().strip().split("\n")
        kind = next(line[len("event: "):] for line in lines if line.startswith("event: "))
        self.events.append((kind, json.loads(next(line[len("data: "):] for line in lines if line.startswith("data: ")))))


def test_a_streams_blocks_start_when_the_kind_changes_and_stop_before_the_next():
    response = Written()

    async def stream() -> None:
        blocks = Blocks(response)
        await blocks.write("thinking", "Hm")
        await blocks.write("thinking", "m.")
        await blocks.write("text", "")  # nothing: no block
        await blocks.write("text", "Four")
        await blocks.call({"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}})
        await blocks.write("text", "Done.")
        await blocks.close()
        await blocks.close()  # closed already: nothing more

    asyncio.run(stream())
    start, delta, stop = "content_block_start", "content_block_delta", "content_block_stop"
    assert response.events == [
        (start, {"type": start, "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        (delta, {"type": delta, "index": 0, "delta": {"type": "thinking_delta", "thinking": "Hm"}}),
        (delta, {"type": delta, "index": 0, "delta": {"type": "thinking_delta", "thinking": "m."}}),
        (stop, {"type": stop, "index": 0}),
        (start, {"type": start, "index": 1, "content_block": {"type": "text", "text": ""}}),
        (delta, {"type": delta, "index": 1, "delta": {"type": "text_delta", "text": "Four"}}),
        (stop, {"type": stop, "index": 1}),
        (start, {"type": start, "index": 2, "content_block": {"type": "tool_use", "id": "toolu_1", "name": "weather",
                                                               "input": {}}}),
        (delta, {"type": delta, "index": 2, "delta": {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}}),
        (stop, {"type": stop, "index": 2}),
        (start, {"type": start, "index": 3, "content_block": {"type": "text", "text": ""}}),
        (delta, {"type": delta, "index": 3, "delta": {"type": "text_delta", "text": "Done."}}),
        (stop, {"type": stop, "index": 3}),
    ]
