"""Structured outputs through the gateway with the OpenAI SDK, on a random-weight model: every
constrained answer parses and validates; bad constraints are 400s naming the field."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.service_helpers import MODEL_NAME


class Block(BaseModel):
    kind: Literal["free", "owned", "shared"]
    refcount: int = Field(ge=0, le=64)
    holders: list[Annotated[str, Field(max_length=4)]] = Field(max_length=2)  # bounded: a random model's strings end


def test_chat_completions_parse_with_a_pydantic_model(client):
    for seed in range(12):
        r = client.chat.completions.parse(model=MODEL_NAME, messages=[{"role": "user", "content": f"block {seed}"}],
                                          response_format=Block, max_tokens=120, temperature=1.0, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Block), choice.message.content


SCHEMA = {"type": "object", "properties": {"page": {"type": "integer", "minimum": 0, "maximum": 4096},
                                           "dirty": {"type": "boolean"}},
          "required": ["page", "dirty"], "additionalProperties": False}


@pytest.mark.parametrize("extra, check", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "page", "schema": SCHEMA}}},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"guided_regex": r"[A-Z]{2}-[0-9]{3}"}, lambda t: re.fullmatch(r"[A-Z]{2}-[0-9]{3}", t) is not None),
    ({"guided_choice": ["hit", "miss"]}, lambda t: t in ("hit", "miss")),
    ({"structured_outputs": {"grammar": 'root ::= "cow" ("-" "cow")*'}}, lambda t: re.fullmatch(r"cow(-cow)*", t) is not None),
])
def test_completions_follow_every_way_of_asking(client, extra, check):
    r = client.completions.create(model=MODEL_NAME, prompt=[f"case {i}" for i in range(8)], max_tokens=60,
                                  temperature=1.0, seed=3, extra_body=extra)
    assert all(c.finish_reason == "stop" and check(c.text) for c in r.choices), [c.text for c in r.choices]


def test_streamed_constrained_chat_reassembles_to_valid_json(client):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "page?"}],
                                            max_tokens=60, temperature=1.0, seed=5, stream=True,
                                            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "(open"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_choice": "not a list"}, "guided_choice"),
    ({"structured_outputs": {"colour": "red"}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"use_beam_search": True, "beam_width": 2, "guided_regex": "a+"}, "use_beam_search"),
])
def test_bad_constraints_are_400s_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4, extra_body=extra)
    assert err.value.body["param"] == param, err.value.body


def test_a_constraint_is_checked_once_per_request_and_compiled_once(client, monkeypatch):
    """The gateway checks each request's constraint once (off its event loop); the worker compiles
    a distinct constraint once, however many requests share it (counted at both ends)."""
    import pagedserve.runtime.structured_grammar as at_gateway
    import pagedserve.worker.runner.sampling.structured_masks as at_worker

    calls = {"gateway": 0, "worker": 0}

    def counted(side, real):
        def grammar_text(structured):
            calls[side] += 1
            return real(structured)
        return grammar_text

    monkeypatch.setattr(at_gateway, "grammar_text", counted("gateway", at_gateway.grammar_text))
    monkeypatch.setattr(at_worker, "grammar_text", counted("worker", at_worker.grammar_text))
    for seed in range(2):
        r = client.completions.create(model=MODEL_NAME, prompt="once", max_tokens=8, temperature=1.0, seed=seed,
                                      extra_body={"guided_regex": "once-[0-9]{2}"})
        assert re.fullmatch(r"once-[0-9]{2}", r.choices[0].text)
    assert calls == {"gateway": 2, "worker": 1}
