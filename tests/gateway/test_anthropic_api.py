"""``POST /v1/messages`` with the official ``anthropic`` SDK, unchanged, against a live stack: the
answer is the chat completion's (same template, sampling and seed), streamed events reassemble to
it, a tool round trip, errors in Anthropic's shape, ``x-api-key``."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.service_helpers import MODEL_NAME

CITY = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"name": "weather", "description": "forecast for a city", "input_schema": CITY}]
SEEDED = {"temperature": 1.0, "top_k": 40}  # sampling fields: the SDK (2.x) sends them only as extra_body


@pytest.fixture(scope="module")
def claude(stack):
    return anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0, timeout=60)


STOP_REASON = {"length": "max_tokens", "stop": "end_turn", "tool_calls": "tool_use"}  # the chat's finish_reason ->


def chat_choice(client, system: str, content: str, max_tokens: int, seed: int):
    """What the chat completions route answers for the same conversation and seed."""
    body = {"model": MODEL_NAME, "max_tokens": max_tokens, "seed": seed, "extra_body": SEEDED,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}]}
    return client.chat.completions.create(**body).choices[0]


def chat_content(client, system: str, content: str, max_tokens: int, seed: int) -> str:
    return chat_choice(client, system, content, max_tokens, seed).message.content


def test_a_message_is_the_chat_completion_of_the_same_conversation(stack, claude, client):
    message = claude.messages.create(model=MODEL_NAME, max_tokens=12, system="be brief", extra_body={"seed": 5, **SEEDED},
                                     messages=[{"role": "user", "content": [{"type": "text", "text": "pages?"}]}])
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    chat = chat_choice(client, "be brief", "pages?", 12, seed=5)
    assert message.stop_reason == STOP_REASON[chat.finish_reason] and message.usage.output_tokens <= 12
    text = "".join(block.text for block in message.content if block.type == "text")
    assert text == chat.message.content
    prompt = httpx.post(stack.url + "/tokenize", json={"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "pages?"}]}).json()["count"]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == prompt  # Anthropic's split


def test_a_matched_stop_sequence_is_the_stop_reason_with_the_string(claude):
    """A seeded answer, then the same ask with a piece of its text as a stop sequence (and one that
    never appears): it ends before the piece with ``stop_sequence`` and the piece, whole and streamed."""
    ask = dict(model=MODEL_NAME, max_tokens=24, messages=[{"role": "user", "content": "pages?"}],
               extra_body={"seed": 4, **SEEDED})
    first = claude.messages.create(**ask)
    text = first.content[0].text
    piece = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(piece) == 3, text
    stopped = claude.messages.create(**ask, stop_sequences=["<never>", piece])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", piece)
    assert stopped.content[0].text == text[: text.index(piece)]
    with claude.messages.stream(**ask, stop_sequences=["<never>", piece]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", piece)
    plain = claude.messages.create(**ask, stop_sequences=["<never>"])
    assert (plain.stop_reason, plain.stop_sequence) == (first.stop_reason, None) and first.stop_reason != "stop_sequence"


def test_streamed_events_reassemble_to_the_message(claude):
    ask = dict(model=MODEL_NAME, max_tokens=16, messages=[{"role": "user", "content": "blocks?"}],
               extra_body={"seed": 9, **SEEDED})
    whole = claude.messages.create(**ask)
    with claude.messages.stream(**ask) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)


def test_a_streams_frames_open_with_the_prompts_usage_and_close_with_message_stop(stack):
    """The raw frames: ``message_start`` carries the prompt's tokens (as the whole answer's usage
    counts them), the last frame is ``message_stop``, and an answer that ends without a stop
    sequence names none."""
    body = {"model": MODEL_NAME, "max_tokens": 3, "messages": [{"role": "user", "content": "frames?"}],
            "seed": 2, **SEEDED}
    whole = httpx.post(stack.url + "/v1/messages", json=body, timeout=60).json()
    r = httpx.post(stack.url + "/v1/messages", json={**body, "stream": True}, timeout=60)
    frames = [(head[7:], json.loads(data[6:])) for head, data in
              zip(r.text.splitlines()[0::3], r.text.splitlines()[1::3])]
    assert [name for name, _ in frames] == [data["type"] for _, data in frames]  # each frame's event is its type
    assert frames[0][0] == "message_start" and frames[-1] == ("message_stop", {"type": "message_stop"})
    start = frames[0][1]["message"]
    assert start["usage"]["input_tokens"] == whole["usage"]["input_tokens"] > 0 and start["stop_reason"] is None
    delta = next(data for name, data in frames if name == "message_delta")
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}


@pytest.mark.parametrize("streamed", [False, True])
def test_a_tool_round_trip(claude, streamed):
    ask = dict(model=MODEL_NAME, max_tokens=40, tools=TOOLS, tool_choice={"type": "tool", "name": "weather"},
               messages=[{"role": "user", "content": "weather in paris?"}], extra_body={"seed": 2, **SEEDED})
    if streamed:
        with claude.messages.stream(**ask) as stream:
            first = stream.get_final_message()
    else:
        first = claude.messages.create(**ask)
    call = next(block for block in first.content if block.type == "tool_use")
    assert first.stop_reason == "tool_use" and call.name == "weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, CITY)
    def answered(result: str):
        return claude.messages.create(model=MODEL_NAME, max_tokens=4, tools=TOOLS, extra_body={"seed": 2, **SEEDED}, messages=[
            {"role": "user", "content": "weather in paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": "weather", "input": call.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]}])

    second, longer = answered("sunny, 21 C"), answered("sunny, 21 C, then rain from the west by evening")
    assert second.stop_reason == "max_tokens" and second.usage.output_tokens == 4  # seeded: four tokens of text
    prompt = lambda message: message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert prompt(second) > prompt(first)  # the call and its result reached the template
    assert prompt(longer) > prompt(second)  # the result's own text did, not just its turn


def test_tool_choice_any_calls_a_tool_and_none_calls_none(claude):
    """``any`` must call one of the tools (a grammar of calls: OpenAI's ``required``); ``none`` writes
    text with the tools still shown to the template; ``auto`` is the model's choice (random weights
    here write text, seeded)."""
    ask = dict(model=MODEL_NAME, max_tokens=48, tools=TOOLS, messages=[{"role": "user", "content": "weather in paris?"}],
               extra_body={"seed": 4, **SEEDED})
    forced = claude.messages.create(**ask, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    calls = [block for block in forced.content if block.type == "tool_use"]
    assert forced.stop_reason == "tool_use" and [c.name for c in calls] == ["weather"]
    for call in calls:
        jsonschema.validate(call.input, CITY)
    for choice in ({"type": "none"}, {"type": "auto"}):
        answer = claude.messages.create(**ask, tool_choice=choice)
        assert [block.type for block in answer.content] == ["text"] and answer.stop_reason == "max_tokens", choice
    prompt = lambda usage: usage.input_tokens + usage.cache_read_input_tokens
    bare = claude.messages.create(**{k: v for k, v in ask.items() if k != "tools"})
    assert prompt(answer.usage) > prompt(bare.usage)  # with "none" the template still saw the tools


def test_an_earlier_answers_thinking_sent_back_is_taken_and_left_out_of_the_prompt(claude):
    """Clients send an answer back whole, its thinking blocks too (Anthropic's SDKs do, with tools): taken,
    and the template sees the answer without them, as Anthropic strips earlier turns' thinking; in a
    user's turn a thinking block is a 400."""
    def asked(*assistant_blocks):
        return claude.messages.create(model=MODEL_NAME, max_tokens=2, extra_body={"seed": 1, **SEEDED}, messages=[
            {"role": "user", "content": "pages?"}, {"role": "assistant", "content": list(assistant_blocks)},
            {"role": "user", "content": "and blocks?"}])

    text = {"type": "text", "text": "fixed-size pages"}
    plain = asked(text)
    thought = asked({"type": "thinking", "thinking": "a long chain of thought " * 20, "signature": ""}, text,
                    {"type": "redacted_thinking", "data": "opaque"})
    prompt = lambda message: message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert prompt(thought) == prompt(plain) and thought.content[0].text == plain.content[0].text
    with pytest.raises(anthropic.BadRequestError, match="belong to the assistant"):
        claude.messages.create(model=MODEL_NAME, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": ""}]}])


@pytest.mark.parametrize("body, kind", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "invalid_request_error"),  # max_tokens is required
    ({"max_tokens": 4, "messages": []}, "invalid_request_error"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "invalid_request_error"),
    ({"max_tokens": 4, "temperature": 1.5, "messages": [{"role": "user", "content": "hi"}]}, "invalid_request_error"),
    ({"max_tokens": 4, "tool_choice": {"type": "tool"}, "tools": TOOLS, "messages": [{"role": "user", "content": "hi"}]},
     "invalid_request_error"),
    ({"max_tokens": 4, "model": "nope", "messages": [{"role": "user", "content": "hi"}]}, "not_found_error"),
])
def test_bad_requests_are_answered_in_anthropics_error_shape(stack, body, kind):
    r = httpx.post(stack.url + "/v1/messages", json={"model": MODEL_NAME, **body})
    assert r.status_code == (404 if kind == "not_found_error" else 400), r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind and r.json()["error"]["message"]


def test_the_sdk_raises_its_own_errors(claude):
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"temperature": 3.0})
    assert err.value.body["error"]["type"] == "invalid_request_error" and "temperature" in err.value.message


def test_x_api_key_opens_a_keyed_gateway(stack):
    url = stack.add_gateway(api_keys=("k-anthropic",))
    ask = dict(model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert anthropic.Anthropic(base_url=url, api_key="k-anthropic", max_retries=0).messages.create(**ask).content
    with pytest.raises(anthropic.AuthenticationError) as err:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(**ask)
    assert err.value.body["error"]["type"] == "authentication_error"
    assert json.loads(httpx.post(url + "/v1/chat/completions", json={}).text)["error"]["code"] == "invalid_api_key"
