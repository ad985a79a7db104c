"""The engine on real weights: SmolLM2-135M-Instruct from its GGUF (the default model), against
transformers reading the same file. Greedy output token for token on twelve chat prompts, alone
and batched, under preemption, on prefix-cache hits and in ``n > 1`` forks; logprobs against
transformers' log-softmax; streamed text against ``tokenizer.decode`` across multi-byte
characters; a JSON schema answered right. Float32, so the comparison is exact up to rounding."""

from __future__ import annotations

import collections
import json

import jsonschema
import pytest

from pagedserve import LLM
from pagedserve.shared.sampling import SamplingParams
from pagedserve.shared.structured import StructuredOutputs
from tests.engine.test_parity import run_checked
from tests.real_model import CHAT_PROMPTS

NEW = 24


@pytest.fixture(scope="module")
def llm(real_model):
    return LLM(real_model.gguf, device="cpu", dtype="float32", num_gpu_blocks=512, seed=0)


def greedy(max_tokens: int = NEW, **fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **fields)


def test_the_default_model_answers(llm, real_model):
    out = llm.generate([real_model.chat_ids("What is the capital of France?")], greedy(), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


def test_greedy_equals_transformers_alone_and_batched(llm, real_model):
    prompts = [real_model.chat_ids(p) for p in CHAT_PROMPTS]
    refs = [real_model.hf_greedy(p, NEW) for p in prompts]
    for prompt, ref in zip(prompts[:3], refs[:3]):  # one request in the engine
        assert llm.generate([prompt], greedy(), use_tqdm=False)[0].outputs[0].token_ids == ref
    done = run_checked(llm, prompts, [greedy()] * len(prompts))  # twelve in one batch
    for i, ref in enumerate(refs):
        assert done[i].outputs[0].token_ids == ref, f"prompt {i}: {CHAT_PROMPTS[i]!r}"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_equals_transformers_under_preemption(real_model, mode):
    prompts = [real_model.chat_ids(p) for p in CHAT_PROMPTS]
    llm = LLM(real_model.gguf, device="cpu", dtype="float32", num_gpu_blocks=24, num_cpu_blocks=64,
              preemption_mode=mode, max_num_batched_tokens=128, seed=0)
    done = run_checked(llm, prompts, [greedy()] * len(prompts))
    assert llm.engine.scheduler.stats.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert done[i].outputs[0].token_ids == real_model.hf_greedy(prompt, NEW), f"prompt {i}"


def test_greedy_equals_transformers_on_prefix_cache_hits_and_forks(llm, real_model):
    prompts = [real_model.chat_ids(p) for p in CHAT_PROMPTS[:6]]
    stats = llm.engine.scheduler.stats
    hits = stats.prefix_hit_tokens
    run_checked(llm, prompts, [greedy()] * len(prompts))  # every prompt now cached
    done = run_checked(llm, prompts, [greedy(n=3)] * len(prompts))  # hits, then three forks each
    assert stats.prefix_hit_tokens - hits >= sum(len(p) // 16 * 16 for p in prompts)
    for i, prompt in enumerate(prompts):
        ref = real_model.hf_greedy(prompt, NEW)
        assert [c.token_ids for c in done[i].outputs] == [ref] * 3, f"prompt {i}"


def test_the_c_layer_kernels_carry_every_layer_of_every_step(llm, real_model, monkeypatch):
    """On the CPU a layer's norms, rotary with the K/V store and SiLU are C kernels
    (``paged_kernels/native_layer_ops.py``). Each hands back what it cannot take to the layer's torch
    code, so a layout it stopped recognising (a one-token view's strides, say) would only show as a
    slower step: here every call of the prompt's forward is taken, each decode runs the layers as
    direct C calls (``worker/runner/cpu/native_stack.py``, which runs only where every layer is the
    kernels'), and the tokens are transformers'."""
    model = llm.engine.runner.model
    kernels = model.model.layers[0].self_attn.kernels
    assert kernels is not None and model.native_stack is not None
    calls: collections.Counter = collections.Counter()
    for name in ("rms_norm", "rope_store", "silu_mul"):
        def spy(*args, _real=getattr(kernels, name), _name=name):
            out = _real(*args)
            calls[_name, out is not None and out is not False] += 1
            return out
        monkeypatch.setattr(kernels, name, spy)

    def stack_spy(*args, _real=model.native_stack):
        out = _real(*args)
        calls["stack", out is not None] += 1
        return out
    monkeypatch.setattr(model, "native_stack", stack_spy)
    prompt = real_model.chat_ids("Name three primary colors.")
    llm.engine.forget_cached()  # a prefix hit's short tail would run through the stack, as decodes
    assert llm.generate([prompt], greedy(4), use_tqdm=False)[0].outputs[0].token_ids == real_model.hf_greedy(prompt, NEW)[:4]
    layers, decodes = 30, 3  # the prompt's forward through the modules, then three decodes through the stack
    assert calls == {("rms_norm", True): 2 * layers + 1 + decodes, ("rope_store", True): layers,
                     ("silu_mul", True): layers, ("stack", False): 1, ("stack", True): decodes}


def test_logprobs_equal_transformers_log_softmax(llm, real_model):
    prompt = real_model.chat_ids("Name three primary colors.")
    out = llm.generate([prompt], greedy(16, logprobs=3), use_tqdm=False)[0].outputs[0]
    expected = real_model.hf_logprobs(prompt, out.token_ids)
    got = [entry[token].logprob for token, entry in zip(out.token_ids, out.logprobs)]
    assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-4, list(zip(got, expected))


def test_prompt_logprobs_equal_transformers_in_chunks_after_a_cache_hit_and_a_preemption(real_model):
    """Every prompt position's logprob of its own token, and the top-2: a prompt prefilled in
    chunks of 48, asked again (its blocks are cached, but it is computed in full), and squeezed by
    other requests into a preemption."""
    prompt = real_model.chat_ids(" ".join(CHAT_PROMPTS[:8]))
    expected = real_model.hf_logprobs(prompt[:1], prompt[1:])
    llm = LLM(real_model.gguf, device="cpu", dtype="float32", num_gpu_blocks=16, max_num_batched_tokens=48, seed=0)
    params = greedy(4, prompt_logprobs=2)
    others = [real_model.chat_ids(p) for p in CHAT_PROMPTS[8:]]
    runs = [run_checked(llm, [prompt], [params])[0], run_checked(llm, [prompt], [params])[0],
            run_checked(llm, [*others, prompt], [greedy(60)] * len(others) + [params])[len(others)]]  # arrives last,
    assert llm.engine.scheduler.stats.num_preemptions > 0  # so it is the one preempted
    for out in runs:
        entries = out.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        assert [e.token_id for e in entries[1:]] == prompt[1:]
        assert max(abs(e.logprob - x) for e, x in zip(entries[1:], expected)) < 1e-4
        for e in entries[1:]:
            assert e.token_id in e.top_logprobs and 2 <= len(e.top_logprobs) <= 3
            assert max(e.top_logprobs.values()) >= e.logprob


@pytest.mark.parametrize("question", ["안녕하세요! 자기소개 해주세요.", "用中文介绍一下北京。",
                                      "Reply with three emoji that describe happiness 😀"])
def test_streamed_text_equals_decode_across_multibyte_characters(llm, real_model, question):
    """No step releases half a character; a sequence cut off inside one (max_tokens) ends with
    what ``decode`` gives for it."""
    deltas, tokens = stream(llm, real_model.chat_ids(question), greedy(40))
    assert "".join(deltas) == real_model.tokenizer.decode(tokens, skip_special_tokens=True)
    assert not any("\ufffd" in delta for delta in deltas[:-1])


@pytest.mark.parametrize("question", ["用中文介绍一下北京。", "Reply with three emoji that describe happiness 😀"])
def test_a_stop_string_ending_inside_a_multibyte_character(llm, real_model, question):
    """The stop string is the output's second character, whose bytes the byte-level BPE splits
    across tokens: the text ends right before it, never with half a character."""
    prompt = real_model.chat_ids(question)
    full = real_model.tokenizer.decode(real_model.hf_greedy(prompt, 40), skip_special_tokens=True)
    stop = full[1]
    assert len(stop.encode()) > 1 and len(real_model.tokenizer.encode(stop, add_special_tokens=False)) > 1
    deltas, _ = stream(llm, prompt, greedy(40, stop=[stop]))
    assert "".join(deltas) == full[:full.index(stop)]


def test_json_schema_answer_is_valid_and_right(llm, real_model):
    schema = {"type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
              "required": ["country", "capital"], "additionalProperties": False}
    prompt = real_model.chat_ids("What is the capital of France? Answer in JSON with the keys country and capital.")
    out = llm.generate([prompt], greedy(48, structured=StructuredOutputs(json=schema)), use_tqdm=False)[0].outputs[0]
    value = json.loads(out.text)
    jsonschema.validate(value, schema)
    assert value["capital"] == "Paris"


def stream(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list[str], list[int]]:
    """Run one request step by step: the text each step released, and the tokens."""
    engine = llm.engine
    engine.add_request("streamed", prompt, params)
    deltas, tokens = [], []
    while engine.has_unfinished():
        for out in engine.step():
            if out.outputs[0].text_delta:
                deltas.append(out.outputs[0].text_delta)
            tokens = out.outputs[0].token_ids
    return deltas, tokens
