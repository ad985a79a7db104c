"""The OpenAI objects a gateway writes (``gateway/answers/openai_chunks.py``), built from wire events without a
stack: whole responses and stream chunks of chat and text completions, logprobs in both shapes
(chat's token/bytes/top list, completions' parallel lists with text offsets), echo, usage, and
tool calls in a chat's answer. Each expected object is written out whole."""

from __future__ import annotations

import pytest

from pagedserve.gateway.answers.openai_chunks import Choice, Renderer, tool_finish, usage
from pagedserve.gateway.answers.tool_calls import ToolRequest
from pagedserve.shared.protocol import OutputDelta

HEAD = {"id": "req-1", "created": 1700000000, "model": "m"}
TOOLS = (
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
)


def entry(token: str, logprob: float, top: dict[str, float] | None) -> dict:
    """A logprob entry as the worker sends it: ids, and each id's text."""
    ids = {text: i for i, text in enumerate(sorted({token, *(top or {})}))}
    return {"token_id": ids[token], "token": token, "logprob": logprob,
            "top": None if top is None else {ids[t]: lp for t, lp in top.items()},
            "top_tokens": {i: t for t, i in ids.items()}}


def renderer(chat: bool, top_logprobs: int | None = None, tools: ToolRequest | None = None) -> Renderer:
    return Renderer(chat, "req-1", 1700000000, "m", top_logprobs, tools)


def test_usage_adds_up():
    assert usage(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert usage(3, 4, 2)["prompt_tokens_details"] == {"cached_tokens": 2}


def test_a_choice_gathers_text_logprobs_and_keeps_its_last_finish_reason():
    choice = Choice(0)
    choice.add(OutputDelta(0, [1], "Hel", None, [entry("Hel", -0.5, None)]))
    choice.add(OutputDelta(0, [2], "lo", "length", None))
    choice.add(OutputDelta(0, [], "", None))  # a later delta without a reason keeps the one it had
    assert (choice.text, choice.finish_reason, len(choice.logprobs)) == ("Hello", "length", 1)
    choice.echo("Say: ", [entry("Say", -1.0, None)])
    assert choice.text == "Say: Hello" and [e["token"] for e in choice.logprobs] == ["Say", "Hel"]


def test_a_whole_text_completion():
    choice = Choice(1, "Paris.", [], "stop", "\n")  # ended by the stop string "\n": vLLM's stop_reason says so
    assert renderer(False).response([choice], usage(5, 2)) == {
        **HEAD, "object": "text_completion",
        "choices": [{"index": 1, "logprobs": None, "finish_reason": "stop", "stop_reason": "\n", "text": "Paris."}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }


def test_a_whole_chat_completion_without_tools():
    choice = Choice(0, "Hi there", [], "length")
    assert renderer(True).response([choice], usage(1, 2)) == {
        **HEAD, "object": "chat.completion",
        "choices": [{"index": 0, "logprobs": None, "finish_reason": "length", "stop_reason": None,
                     "message": {"role": "assistant", "content": "Hi there"}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }


def test_a_chat_answer_that_calls_a_tool_ends_for_the_calls():
    tools = ToolRequest(TOOLS, "auto")
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    body = renderer(True, tools=tools).response([Choice(0, text, [], "stop")], usage(1, 1))
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert message["content"] == "Let me look."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    # a cut answer says so; plain text stays content; tool_choice none parses nothing
    cut = renderer(True, tools=tools).response([Choice(0, text, [], "length")], usage(1, 1))
    assert cut["choices"][0]["finish_reason"] == "length"
    plain = renderer(True, tools=tools).response([Choice(0, "No call.", [], "stop")], usage(1, 1))
    assert plain["choices"][0] == {"index": 0, "logprobs": None, "finish_reason": "stop", "stop_reason": None,
                                   "message": {"role": "assistant", "content": "No call."}}
    none = renderer(True, tools=ToolRequest(TOOLS, "none")).response([Choice(0, text, [], "stop")], usage(1, 1))
    assert none["choices"][0]["message"] == {"role": "assistant", "content": text}


def test_chat_logprobs_list_exactly_the_asked_alternatives_best_first_with_bytes():
    entries = [entry("é", -0.25, {"é": -0.25, "e": -1.5, "a": -3.0})]
    assert renderer(True, top_logprobs=2).logprobs(entries, 0) == {"content": [
        {"token": "é", "logprob": -0.25, "bytes": [195, 169],
         "top_logprobs": [{"token": "é", "logprob": -0.25, "bytes": [195, 169]},
                          {"token": "e", "logprob": -1.5, "bytes": [101]}]},
    ]}
    assert renderer(True, top_logprobs=0).logprobs(entries, 0)["content"][0]["top_logprobs"] == []
    assert renderer(True).logprobs(entries, 0) is None  # none asked for


def test_completion_logprobs_are_parallel_lists_with_text_offsets():
    entries = [entry("The", -0.1, {"The": -0.1, "A": -2.0}), entry(" sky", -0.7, {" sky": -0.7}),
               entry(" is", -0.2, None)]
    assert renderer(False, top_logprobs=1).logprobs(entries, 10) == {
        "tokens": ["The", " sky", " is"],
        "token_logprobs": [-0.1, -0.7, -0.2],
        "top_logprobs": [{"The": -0.1, "A": -2.0}, {" sky": -0.7}, None],  # None: an echoed prompt's first token
        "text_offset": [10, 13, 17],
    }


@pytest.mark.parametrize("chat", [True, False])
def test_stream_chunks(chat):
    r = renderer(chat, top_logprobs=1)
    obj = "chat.completion.chunk" if chat else "text_completion"
    first = r.chunk(0, OutputDelta(0, [7], "Hi", None, [entry("Hi", -0.5, {"Hi": -0.5})]), True, True, text_offset=4)
    logprobs = r.logprobs([entry("Hi", -0.5, {"Hi": -0.5})], 4)
    if chat:
        item = {"index": 0, "logprobs": logprobs, "finish_reason": None, "stop_reason": None,
                "delta": {"role": "assistant", "content": "Hi"}}
    else:
        item = {"index": 0, "logprobs": logprobs, "finish_reason": None, "stop_reason": None, "text": "Hi"}
    assert first == {**HEAD, "object": obj, "choices": [item], "usage": None}
    last = r.chunk(2, OutputDelta(2, [], "", "stop", stop_reason=2), False, False)  # ended by stop token 2
    tail = {"index": 2, "logprobs": r.logprobs([], 0), "finish_reason": "stop", "stop_reason": 2}
    assert last == {**HEAD, "object": obj, "choices": [{**tail, **({"delta": {}} if chat else {"text": ""})}]}
    assert r.usage_chunk(usage(2, 3)) == {**HEAD, "object": obj, "choices": [],
                                          "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}


def test_an_empty_first_chat_chunk_still_opens_the_message():
    r = renderer(True)
    assert r.chunk(0, None, True, False)["choices"][0] == {"index": 0, "logprobs": None, "finish_reason": None,
                                                         "stop_reason": None,
                                                         "delta": {"role": "assistant", "content": ""}}
    assert r.chunk(0, OutputDelta(0, [3], "x"), False, False)["choices"][0]["delta"] == {"content": "x"}


def test_streamed_tool_calls_come_whole_and_numbered():
    r = renderer(True, tools=ToolRequest(TOOLS, "auto"))
    calls = [{"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
             {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    assert r.tool_calls_chunk(1, calls, "stop", True) == {
        **HEAD, "object": "chat.completion.chunk", "usage": None,
        "choices": [{"index": 1, "logprobs": None, "finish_reason": "tool_calls",
                     "delta": {"tool_calls": [{"index": 0, **calls[0]}, {"index": 1, **calls[1]}]}}],
    }
    assert "usage" not in r.tool_calls_chunk(0, calls[:1], "length", False)
    assert r.tool_calls_chunk(0, calls[:1], "length", False)["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("reason,expected", [("stop", "tool_calls"), ("length", "length"), (None, None),
                                             ("abort", "abort")])
def test_tool_finish(reason, expected):
    assert tool_finish(reason) == expected


@pytest.mark.parametrize("chat", [True, False])
def test_whole_responses_carry_their_choices_logprobs_from_the_first_character(chat):
    entries = [entry("Hi", -0.5, {"Hi": -0.5}), entry("!", -0.1, {"!": -0.1})]
    r = renderer(chat, top_logprobs=1)
    [item] = r.response([Choice(0, "Hi!", entries, "stop")], usage(1, 2))["choices"]
    assert item["logprobs"] == r.logprobs(entries, 0)
    if not chat:
        assert item["logprobs"]["text_offset"] == [0, 2]
        # a chunk's offsets start at 0 unless the stream says where its text begins
        assert r.chunk(0, OutputDelta(0, [1, 2], "Hi!", None, entries), True, False)["choices"][0]["logprobs"][
            "text_offset"] == [0, 2]
