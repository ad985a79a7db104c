"""Structured outputs on a real (random-weight) model: its output is noise, so every constrained
generation that parses and validates is the constraint's doing. Sampled at temperature 1, 50+
generations per case; strings and numbers are bounded so a random model's output ends. Seeded, so
a run is repeatable; ``jsonschema`` checks every parsed value against its schema."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedserve import LLM
from pagedserve.runtime.structured_grammar import check_structured
from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.sampling import SamplingParams
from pagedserve.shared.structured import StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": -5, "maximum": 500},
        "score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},  # bounded digits (0.25: exact in binary)
        "kind": {"enum": ["block", "page", "slot"]},
        "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                   "active": {"type": "boolean"}},
                  "required": ["name", "active"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 3},
    },
    "required": ["id", "kind", "owner", "tags"],
    "additionalProperties": False,
}
REGEX = r"(0|[1-9][0-9]{0,2})\.[a-f]{2,4}-(yes|no)"
CHOICES = ["copy-on-write", "paged", "swap"]
EBNF = 'root ::= expr\nexpr ::= term (("+" | "*") term)*\nterm ::= [0-9] | [0-9] [0-9] | "(" expr ")"'
EXPR = re.compile(r"^[0-9+*()]+$")
PROMPTS = [f"request {i}: " + "word " * (i % 7) for i in range(50)]


@pytest.fixture(scope="module")
def llm(zoo):
    return LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=1024, block_size=16)


def constrained(max_tokens: int = 160, n: int = 1, count: int = len(PROMPTS), **kind) -> list[SamplingParams]:
    """One seed per request: different draws for each, the same every run, whatever the batch."""
    return [SamplingParams(temperature=1.0, max_tokens=max_tokens, n=n, seed=i, structured=StructuredOutputs(**kind))
            for i in range(count)]


def texts(outputs) -> list[str]:
    done = [c for o in outputs for c in o.outputs]
    assert all(c.finish_reason == "stop" for c in done), [(c.finish_reason, c.text) for c in done if c.finish_reason != "stop"]
    return [c.text for c in done]


def evaluates(expression: str) -> bool:
    try:
        python = re.sub(r"\b0+(?=[0-9])", "", expression)  # "05" is 5 in the grammar, a syntax error in Python
        eval(compile(python, "<expr>", "eval"), {"__builtins__": {}})  # digits, + * ( ) only: checked first
        return True
    except SyntaxError:
        return False


def test_json_schema_outputs_parse_and_validate(llm):
    outputs = llm.generate(PROMPTS, constrained(json=SCHEMA), use_tqdm=False)
    for text in texts(outputs):
        jsonschema.validate(json.loads(text), SCHEMA)  # json.loads: strict RFC 8259 (no raw control characters)


def test_refs_and_any_of_as_pydantic_writes_them(llm):
    schema = {"$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                                  "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                                  "required": ["x", "y"], "additionalProperties": False}},
              "type": "array", "items": {"anyOf": [{"$ref": "#/$defs/Point"}, {"type": "null"}]}, "minItems": 1, "maxItems": 3}
    outputs = llm.generate(PROMPTS, constrained(json=schema), use_tqdm=False)
    for text in texts(outputs):
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("kind, check", [
    ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t) is not None),
    ({"choice": CHOICES}, lambda t: t in CHOICES),
    ({"grammar": EBNF}, lambda t: EXPR.match(t) is not None and evaluates(t)),
])
def test_regex_choice_and_grammar_outputs_match(llm, kind, check):
    outputs = llm.generate(PROMPTS, constrained(**kind), use_tqdm=False)
    bad = [t for t in texts(outputs) if not check(t)]
    assert not bad, bad


def test_free_rows_in_a_mixed_batch_get_the_tokens_they_get_alone(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:8], greedy, use_tqdm=False)]
    params = [greedy if i % 2 == 0 else constrained(json=SCHEMA)[i] for i in range(16)]
    mixed = llm.generate([p for p in PROMPTS[:8] for _ in (0, 1)], params, use_tqdm=False)
    assert [mixed[i].outputs[0].token_ids for i in range(0, 16, 2)] == alone
    for i in range(1, 16, 2):
        jsonschema.validate(json.loads(mixed[i].outputs[0].text), SCHEMA)


def test_greedy_constrained_is_the_best_allowed_token_each_step(llm):
    """At temperature 0 the constraint picks the unconstrained argmax whenever the grammar allows it:
    a choice list whose first answer is the model's own greedy text comes out in the same tokens."""
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    free = next(c for o in llm.generate(PROMPTS, greedy, use_tqdm=False) for c in o.outputs if "\ufffd" not in c.text)
    prompt = PROMPTS[[o.outputs[0].text for o in llm.generate(PROMPTS, greedy, use_tqdm=False)].index(free.text)]
    choice = SamplingParams(temperature=0.0, max_tokens=20, structured=StructuredOutputs(choice=[free.text, "zzzz"]))
    out = llm.generate([prompt], choice, use_tqdm=False)[0].outputs[0]
    assert out.text == free.text and out.token_ids[:6] == free.token_ids


def test_forks_each_advance_their_own_grammar(llm):
    """n > 1 and best_of fork after the prompt: each child copies the parent's matcher, so a child
    that went one way never constrains its siblings."""
    outputs = llm.generate(PROMPTS[:25], constrained(json=SCHEMA, n=3, count=25), use_tqdm=False)
    done = texts(outputs)
    assert len(done) == 75 and len(set(done)) > 60
    for text in done:
        jsonschema.validate(json.loads(text), SCHEMA)
    best = llm.generate(PROMPTS[:5], SamplingParams(temperature=1.0, max_tokens=40, n=2, best_of=4,
                                                   structured=StructuredOutputs(regex=REGEX)), use_tqdm=False)
    assert all(re.fullmatch(REGEX, t) for t in texts(best))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_valid(zoo, mode):
    tight = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=96, block_size=4, num_cpu_blocks=1024,
                preemption_mode=mode, max_num_batched_tokens=64)
    outputs = tight.generate(PROMPTS[:30], constrained(json=SCHEMA, n=2, count=30), use_tqdm=False)
    assert tight.engine.scheduler.stats.num_preemptions > 0
    for text in texts(outputs):
        jsonschema.validate(json.loads(text), SCHEMA)
    tight.engine.scheduler.blocks.check_invariants()


def test_prefix_cache_hits_keep_outputs_valid(zoo):
    cached = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=512, block_size=4)
    shared_prefix = "the same system prompt for everyone " * 3
    cached.generate([shared_prefix], SamplingParams(max_tokens=1), use_tqdm=False)
    before = cached.engine.scheduler.stats.prefix_hit_tokens
    outputs = cached.generate([shared_prefix + str(i) for i in range(20)], constrained(regex=REGEX, count=20), use_tqdm=False)
    assert cached.engine.scheduler.stats.prefix_hit_tokens > before
    assert all(re.fullmatch(REGEX, t) for t in texts(outputs))


def test_max_tokens_mid_structure_finishes_with_length_never_a_silent_cut(llm):
    outputs = llm.generate(PROMPTS[:10], constrained(json=SCHEMA, max_tokens=4, count=10), use_tqdm=False)
    for o in outputs:
        c = o.outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == 4
        with pytest.raises(json.JSONDecodeError):
            json.loads(c.text)


def test_a_repeated_schema_is_compiled_once(llm):
    compiler = llm.engine.grammars
    a = compiler.compile(StructuredOutputs(json=SCHEMA))
    b = compiler.compile(StructuredOutputs(json=json.dumps(SCHEMA, separators=(",", ":"))))
    assert a is b and a.result().deep_copy() is not a.result()


@pytest.mark.parametrize("kind, message", [
    ({"json": {"type": "nope"}}, "nope"),
    ({"json": {"type": "object", "propertyNames": {"maxLength": 3}}}, "propertyNames"),  # unsupported: said, not ignored
    ({"regex": "(unclosed"}, "regex"),
    ({"grammar": "root ::= ("}, "grammar"),
    ({"choice": []}, "choice"),
    ({"regex": "a", "choice": ["b"]}, "exactly one"),
])
def test_invalid_constraints_are_clear_errors(kind, message):
    """A malformed value fails at construction; one llguidance refuses fails the check the gateway
    runs (and the worker's compile, below)."""
    with pytest.raises(InvalidRequestError) as err:
        check_structured(SamplingParams(structured=StructuredOutputs(**kind)).structured)
    assert message in str(err.value) and err.value.field == "structured"


def test_a_constraint_llguidance_refuses_ends_its_request_with_an_error(llm):
    """The worker compiles what the gateway checked; where nobody checked (the offline API, a
    queue producer) the compile's error ends the request, the engine steps on."""
    bad = SamplingParams(max_tokens=4, structured=StructuredOutputs(regex="(unclosed"))
    good = SamplingParams(max_tokens=4, temperature=0.0)
    failed, fine = llm.generate(["a", "b"], [bad, good])
    assert failed.outputs[0].finish_reason == "error" and "regex" in (failed.error or ""), failed
    assert fine.error is None and fine.outputs[0].finish_reason in ("length", "stop")


def test_beam_search_refuses_a_constraint():
    with pytest.raises(InvalidRequestError):
        SamplingParams(use_beam_search=True, beam_width=2, structured=StructuredOutputs(regex="a+"))


def test_the_wire_form_round_trips():
    params = SamplingParams(structured=StructuredOutputs(choice=["a", "b"]))
    assert SamplingParams.from_dict(params.to_dict()) == params
    assert params.to_dict()["structured"] == {"choice": ["a", "b"]}
    with pytest.raises(InvalidRequestError):
        SamplingParams.from_dict({**params.to_dict(), "structured": {"colour": "red"}})
