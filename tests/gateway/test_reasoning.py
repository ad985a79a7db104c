"""Reasoning: ``--reasoning-parser`` splits ``<think>...</think>`` from the answer, whole and streamed
(tags split across deltas at every point), and ``chat_template_kwargs`` reaches the chat template."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from pagedserve.gateway.answers.reasoning import ReasoningCount, ReasoningStream, split
from tests.service_helpers import MODEL_NAME

TEXTS = {  # text -> (deepseek_r1's split, qwen3's split)
    "<think>pages are blocks</think>the answer": (("pages are blocks", "the answer"),) * 2,
    "<think>a</think>b</think>c": (("a", "b</think>c"),) * 2,  # the first close ends the thinking
    "\n<think>\nx</think>\n\ny": (("\nx", "\n\ny"),) * 2,
    "thought first</think>then this": (("thought first", "then this"), (None, "thought first</think>then this")),
    "<think>never closed, cut by max_tokens": (("never closed, cut by max_tokens", None),) * 2,
    "no tags at all < > </": (("no tags at all < > </", None), (None, "no tags at all < > </")),
    "<thi": (("<thi", None), (None, "<thi")),
    "<think></think>": ((None, None),) * 2,
    "": ((None, None),) * 2,
    "<think>a</thinking> b</think>c": (("a</thinking> b", "c"),) * 2,
}


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", sorted(TEXTS))
def test_the_split_streamed_in_any_pieces_is_the_whole_split(parser, text):
    want = TEXTS[text][parser == "qwen3"]
    assert split(text, parser) == want
    for size in (1, 2, 3, 5):
        for start in range(size):  # every cut point, tags split across deltas included
            pieces = [text[:start]] + [text[i:i + size] for i in range(start, len(text), size)]
            stream, thought, answer = ReasoningStream(parser), "", ""
            for i, piece in enumerate(pieces):
                got = stream.feed(piece, final=i == len(pieces) - 1)
                thought, answer = thought + got[0], answer + got[1]
            assert (thought or None, answer or None) == want, (size, start)


def test_a_delta_holds_back_only_what_may_start_the_closing_tag():
    stream = ReasoningStream("deepseek_r1")
    assert stream.feed("<think>abc") == ("abc", "")  # nothing there may start </think>: all out at once
    assert stream.feed("de</thi") == ("de", "")
    assert stream.feed("nk>x") == ("", "x")


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", sorted(TEXTS))
def test_the_thinking_counts_its_tokens_up_to_its_closing_tag_in_any_pieces(parser, text):
    """A character a token: the reasoning tokens are the output's up to the end of ``</think>`` (all of
    it where the thinking never closes), none where the output is all answer; in deltas of several
    tokens, up to the end of the delta that closes it (a delta is not split)."""
    thinks = parser == "deepseek_r1" or text.lstrip().startswith("<think>")
    close = text.find("</think>")
    end = close + len("</think>") if close >= 0 else len(text)
    for size in (1, 2, 3, 5):
        count = ReasoningCount(ReasoningStream(parser))
        pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
        for i, piece in enumerate(pieces):
            count.add(piece, len(piece), final=i == len(pieces) - 1)
        assert count.tokens == (min(len(text), -(-end // size) * size) if thinks else 0), (size, count)


@pytest.fixture(scope="module")
def thinking(stack):
    return openai.OpenAI(base_url=stack.add_gateway(reasoning_parser="deepseek_r1") + "/v1", api_key="x", max_retries=0)


FORCED = {"guided_regex": "[a-z]{2,8}</think>[a-z]{2,8}"}  # a thought, then an answer: random weights write it this way


def test_a_chat_carries_its_reasoning_apart_whole_and_streamed(thinking):
    ask = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "think"}], max_tokens=24, temperature=1.0, seed=3,
               extra_body=FORCED)
    message = thinking.chat.completions.create(**ask).choices[0].message
    assert re.fullmatch("[a-z]{2,8}", message.reasoning_content) and re.fullmatch("[a-z]{2,8}", message.content)
    chunks = list(thinking.chat.completions.create(**ask, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == message.content
    assert not any("<" in (getattr(d, "reasoning_content", None) or "") for d in deltas)  # no tag leaks, whole or in part


def test_without_a_parser_the_thinking_stays_in_the_content(stack):
    plain = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    message = plain.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "think"}],
                                            max_tokens=24, temperature=1.0, seed=3, extra_body=FORCED).choices[0].message
    assert "</think>" in message.content and getattr(message, "reasoning_content", None) is None


def test_chat_template_kwargs_reach_the_template_and_reserved_ones_are_400s(stack):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    plain = httpx.post(stack.url + "/tokenize", json=chat).json()["count"]
    quiet = httpx.post(stack.url + "/tokenize", json={**chat, "chat_template_kwargs": {"enable_thinking": False}})
    assert quiet.status_code == 200 and quiet.json()["count"] > plain  # the template wrote its empty think block
    r = httpx.post(stack.url + "/v1/chat/completions", json={"model": MODEL_NAME, **chat, "max_tokens": 2,
                                                               "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == quiet.json()["count"]
    bad = httpx.post(stack.url + "/v1/chat/completions", json={"model": MODEL_NAME, **chat,
                                                                 "chat_template_kwargs": {"add_generation_prompt": False}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs", bad.text


def test_the_responses_and_messages_apis_carry_the_thinking_as_their_own_items(stack, thinking):
    """deepseek_r1 reads an output that never closes </think> as all thinking: the chat's
    reasoning_content is a Responses reasoning item and a Messages thinking block, whole and streamed."""
    import anthropic
    import httpx

    url = str(thinking.base_url).removesuffix("/v1/")
    ask = {"model": MODEL_NAME, "temperature": 1.0, "extra_body": {"seed": 11}}
    chat = thinking.chat.completions.create(**ask, messages=[{"role": "user", "content": "think"}], max_tokens=10)
    thought = chat.choices[0].message.reasoning_content
    assert thought and chat.choices[0].message.content is None
    made = thinking.responses.create(**ask, input="think", max_output_tokens=10)
    assert [item.type for item in made.output] == ["reasoning"] and made.output[0].content[0].text == thought
    assert made.usage.output_tokens_details.reasoning_tokens == made.usage.output_tokens == 10  # never closed: all thinking
    with thinking.responses.stream(**ask, input="think", max_output_tokens=10) as stream:
        events = list(stream)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    body = {"model": MODEL_NAME, "max_tokens": 10, "messages": [{"role": "user", "content": "think"}],
            "extra_body": {"temperature": 1.0, "seed": 11}}
    message = claude.messages.create(**body)
    assert [b.type for b in message.content] == ["thinking"] and message.content[0].thinking == thought
    with claude.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == thought
    assert httpx.get(url + "/openapi.json").status_code == 200
