"""The Responses API's mapping on its own (``gateway/routes/responses.py``), no stack: a request as the
chat body it amounts to (after a stored conversation), the input's items as chat messages, a worker's
deltas as the response object (output items, status, usage with cached and reasoning tokens), the
stored turn, and the stream's typed events. Every expected object is written out whole, so the
mapping is pinned here (test_responses_api.py checks the same API through a real gateway and worker)."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedserve.gateway.bodies.parse import Limits, parse
from pagedserve.gateway.bodies.responses import ResponsesRequest
from pagedserve.gateway.routes.responses import Answer, Events, chat_body, conversation_of, output_text
from pagedserve.shared.protocol import OutputDelta

WEATHER = {"type": "function", "name": "weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


def test_a_request_is_the_chat_body_it_amounts_to_after_the_stored_conversation():
    req = request(instructions="Be brief.", max_output_tokens=20, temperature=0.5, top_p=0.9, top_k=40, seed=3,
                  stream=True, user="u1", priority=2, parallel_tool_calls=False, tools=[WEATHER], tool_choice="required",
                  text={"format": {"type": "json_object"}})
    history = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "answer"}]
    assert chat_body(req, history) == {
        "model": "m", "messages": [{"role": "system", "content": "Be brief."}, *history, {"role": "user", "content": "hi"}],
        "max_tokens": 20, "stream": True, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "seed": 3, "user": "u1",
        "priority": 2, "parallel_tool_calls": False, "response_format": {"type": "json_object"},
        "tools": [{"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                                    "parameters": WEATHER["parameters"]}}],
        "tool_choice": "required"}
    assert chat_body(request(), []) == {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("fmt,expected", [
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "json_schema", "name": "city", "schema": {"type": "string"}},
     {"type": "json_schema", "json_schema": {"name": "city", "schema": {"type": "string"}}}),
    ({"type": "json_schema"}, {"type": "json_schema", "json_schema": {"name": "answer", "schema": {}}}),
])
def test_text_format_is_the_chats_response_format(fmt, expected):
    assert chat_body(request(text={"format": fmt}), []).get("response_format") == expected


def test_tools_and_tool_choice_are_the_chats():
    bare = {"type": "function", "name": "now"}
    body = chat_body(request(tools=[bare], tool_choice={"type": "function", "name": "now"}), [])
    assert body["tools"] == [{"type": "function", "function": {"name": "now", "description": "",
                                                               "parameters": {"type": "object"}}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "now"}}
    assert chat_body(request(tools=[bare], tool_choice="none"), [])["tool_choice"] == "none"


def test_the_inputs_items_become_chat_messages_consecutive_calls_in_one():
    req = request(input=[
        {"role": "developer", "content": "Use the tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Paris"},
                                                        {"type": "input_text", "text": "and Rome?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": "21 C"},
        {"role": "assistant", "content": "Mild."},
        {"type": "function_call", "call_id": "call_3", "name": "weather", "arguments": "{}"},
    ])
    call = lambda id_, args: {"id": id_, "type": "function", "function": {"name": "weather", "arguments": args}}  # noqa: E731
    assert conversation_of(req) == [
        {"role": "developer", "content": "Use the tools."},
        {"role": "user", "content": "Paris\nand Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [call("call_1", '{"city": "Paris"}'),
                                                            call("call_2", '{"city": "Rome"}')]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "21 C"},
        {"role": "assistant", "content": "Mild."},
        {"role": "assistant", "content": "", "tool_calls": [call("call_3", "{}")]},  # after a message: its own
    ]
    assert conversation_of(request(input="plain")) == [{"role": "user", "content": "plain"}]


def answer(reasoning_parser: str | None = None, tools: bool = False, **fields) -> Answer:
    req = request(tools=[WEATHER] if tools else None, **fields)
    return Answer(req, parse(chat_body(req, []), True, Limits()), "hermes", reasoning_parser)


def fed(got: Answer, *pieces: tuple[str, int], finish: str = "stop") -> Answer:
    for i, (text, tokens) in enumerate(pieces):
        got.add(OutputDelta(0, list(range(tokens)), text, finish if i == len(pieces) - 1 else None))
    return got


def test_an_answer_is_the_response_object_with_its_usage():
    got = fed(answer(instructions="Be brief.", max_output_tokens=9, temperature=0.25, metadata={"k": "v"}, user="u1",
                     previous_response_id="resp_0"), ("Hello", 2), (" there.", 3))
    assert got.id.startswith("resp_") and got.message_id.startswith("msg_")
    assert got.response(40, cached_tokens=32) == {
        "id": got.id, "object": "response", "created_at": got.created, "status": "completed", "error": None,
        "incomplete_details": None, "instructions": "Be brief.", "max_output_tokens": 9, "model": "m",
        "output": [{"type": "message", "id": got.message_id, "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": "Hello there.", "annotations": [], "logprobs": []}]}],
        "parallel_tool_calls": True, "previous_response_id": "resp_0", "temperature": 0.25, "top_p": 1.0,
        "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}}, "store": True,
        "metadata": {"k": "v"}, "user": "u1",
        "usage": {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32}, "output_tokens": 5,
                  "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 45}}
    assert got.turn() == [{"role": "assistant", "content": "Hello there."}]
    assert got.response(40)["usage"]["input_tokens_details"] == {"cached_tokens": 0}  # none read from the cache


def test_the_requests_choices_are_echoed_in_the_response():
    got = fed(answer(tools=True, tool_choice={"type": "function", "name": "weather"}, parallel_tool_calls=False,
                     store=False), ("Paris", 1))
    response = got.response(5)
    assert response["tool_choice"] == {"type": "function", "name": "weather"}
    assert response["tools"] == [WEATHER] and response["parallel_tool_calls"] is False and response["store"] is False
    fmt = {"type": "json_schema", "name": "city", "schema": {"type": "string"}, "strict": True}
    assert fed(answer(text={"format": fmt}, tool_choice="none"), ('"Paris"', 3)).response(5)["text"] == {"format": fmt}
    assert fed(answer(tool_choice="none"), ("x", 1)).response(5)["tool_choice"] == "none"


def test_an_answer_cut_by_max_output_tokens_is_incomplete():
    got = fed(answer(max_output_tokens=2), ("Hel", 2), finish="length")
    response = got.response(4)
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete"


def test_reasoning_and_calls_are_output_items_and_the_reasoning_tokens_are_counted():
    call_text = 'Checking.<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
    got = fed(answer(reasoning_parser="deepseek_r1", tools=True), ("<think>Look it up.", 5), ("</think>", 1),
              (call_text, 18))
    reasoning, message, call = got.response(10)["output"]
    assert reasoning == {"type": "reasoning", "id": got.reasoning_id, "summary": [],
                         "content": [{"type": "reasoning_text", "text": "Look it up."}], "status": "completed"}
    assert message["content"][0]["text"] == "Checking."
    call_id = call["call_id"]
    assert call == {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"), "call_id": call_id,
                    "name": "weather", "arguments": '{"city": "Paris"}', "status": "completed"}
    usage = got.response(10)["usage"]
    assert (usage["output_tokens_details"]["reasoning_tokens"], usage["output_tokens"]) == (6, 24)  # the close tag's too
    assert got.turn() == [{"role": "assistant", "content": "Checking.", "tool_calls": got.parts()[2]}]
    assert got.parts()[2][0]["id"] == call_id  # found once: the call keeps its id
    assert got.reasoning_id.startswith("rs_")


def test_an_answer_of_a_call_alone_has_no_message_item_and_an_empty_turn():
    got = fed(answer(tools=True), ('<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>', 12))
    [call] = got.response(3)["output"]
    assert call["type"] == "function_call" and call["arguments"] == '{"city": "Oslo"}'
    assert got.turn() == [{"role": "assistant", "content": "", "tool_calls": got.parts()[2]}]


def test_a_parser_whose_output_starts_inside_the_thinking_counts_it_without_an_open_tag():
    got = fed(answer(reasoning_parser="deepseek_r1"), ("Two and two.", 4), ("</think>", 1), ("Four.", 2))
    assert got.response(3)["usage"]["output_tokens_details"] == {"reasoning_tokens": 5}
    assert got.response(3)["output"][0]["content"] == [{"type": "reasoning_text", "text": "Two and two."}]


def test_an_echoed_format_leaves_out_what_the_request_left_out():
    fmt = {"type": "json_schema", "name": "city", "schema": {"type": "string"}}  # no "strict"
    assert fed(answer(text={"format": fmt}), ('"Oslo"', 3)).response(5)["text"] == {"format": fmt}


class Written:
    """A stream response that keeps what is written (the SSE frames), as events."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    async def write(self, frame: bytes) -> None:
        lines = frame.decode().split("\n")
        event = json.loads(next(line for line in lines if line.startswith("data: "))[len("data: "):])
        assert f"event: {event['type']}" in lines  # the SSE event name is the type, as the SDK dispatches on it
        self.events.append(event)


def test_a_streams_items_are_added_when_their_text_first_comes_and_done_before_the_next():
    got = answer()
    response = Written()
    call = {"id": "call_7", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}

    async def stream() -> list[dict]:
        events = Events(response, got)
        await events.write("reasoning", "Hm")
        await events.write("reasoning", "m.")
        await events.write("message", "")  # nothing: no item
        await events.write("message", "Rome")
        await events.call(call)
        await events.close()  # closed already: nothing more
        return events.items

    items = asyncio.run(stream())
    rs, msg = got.reasoning_id, got.message_id
    reasoning_done = {"type": "reasoning", "id": rs, "summary": [],
                      "content": [{"type": "reasoning_text", "text": "Hmm."}], "status": "completed"}
    message_done = {"type": "message", "id": msg, "status": "completed", "role": "assistant",
                    "content": [output_text("Rome")]}
    call_done = {"type": "function_call", "id": "fc_7", "call_id": "call_7", "name": "weather",
                 "arguments": '{"city": "Rome"}', "status": "completed"}
    expected = [
        {"type": "response.output_item.added", "output_index": 0,
         "item": {"type": "reasoning", "id": rs, "summary": [], "content": [{"type": "reasoning_text", "text": ""}],
                  "status": "completed"}},
        {"type": "response.content_part.added", "item_id": rs, "output_index": 0, "content_index": 0,
         "part": {"type": "reasoning_text", "text": ""}},
        {"type": "response.reasoning_text.delta", "item_id": rs, "output_index": 0, "content_index": 0, "delta": "Hm"},
        {"type": "response.reasoning_text.delta", "item_id": rs, "output_index": 0, "content_index": 0, "delta": "m."},
        {"type": "response.reasoning_text.done", "item_id": rs, "output_index": 0, "content_index": 0, "text": "Hmm."},
        {"type": "response.content_part.done", "item_id": rs, "output_index": 0, "content_index": 0,
         "part": {"type": "reasoning_text", "text": "Hmm."}},
        {"type": "response.output_item.done", "output_index": 0, "item": reasoning_done},
        {"type": "response.output_item.added", "output_index": 1,
         "item": {"type": "message", "id": msg, "status": "in_progress", "role": "assistant", "content": []}},
        {"type": "response.content_part.added", "item_id": msg, "output_index": 1, "content_index": 0,
         "part": output_text("")},
        {"type": "response.output_text.delta", "item_id": msg, "output_index": 1, "content_index": 0, "delta": "Rome",
         "logprobs": []},
        {"type": "response.output_text.done", "item_id": msg, "output_index": 1, "content_index": 0, "text": "Rome",
         "logprobs": []},
        {"type": "response.content_part.done", "item_id": msg, "output_index": 1, "content_index": 0,
         "part": output_text("Rome")},
        {"type": "response.output_item.done", "output_index": 1, "item": message_done},
        {"type": "response.output_item.added", "output_index": 2, "item": {**call_done, "arguments": "", "status": "in_progress"}},
        {"type": "response.function_call_arguments.delta", "item_id": "fc_7", "output_index": 2,
         "delta": '{"city": "Rome"}'},
        {"type": "response.function_call_arguments.done", "item_id": "fc_7", "output_index": 2,
         "arguments": '{"city": "Rome"}', "name": "weather"},
        {"type": "response.output_item.done", "output_index": 2, "item": call_done},
    ]
    assert [e["sequence_number"] for e in response.events] == list(range(len(expected)))
    assert [{k: v for k, v in e.items() if k != "sequence_number"} for e in response.events] == expected
    assert items == [reasoning_done, message_done, call_done]
