"""Greedy output equals Hugging Face transformers token for token, for many concurrent requests,
across model families, block sizes, preemption (both modes), prefix-cache hits, chunked prefill
and copy-on-write forks. Block-manager invariants are checked after every engine step."""

from __future__ import annotations

import pytest

from pagedserve import LLM
from pagedserve.shared.sampling import SamplingParams
from tests.conftest import random_prompts

VOCAB = 512


def run_checked(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], check=None) -> dict:
    """Drive the engine step by step, checking the block manager (and ``check(engine)``) after each step."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out
        engine.scheduler.blocks.check_invariants()
        if check is not None:
            check(engine)
    usage = engine.scheduler.blocks.usage()
    assert usage.used == 0 and usage.free == usage.total, "blocks leaked"
    return done


def assert_parity(zoo, name: str, cases, **llm_kwargs) -> LLM:
    llm = LLM(zoo.path(name), device="cpu", dtype="float32", seed=0, **llm_kwargs)
    prompts = [p for p, _ in cases]
    params = [SamplingParams(temperature=0.0, max_tokens=n) for _, n in cases]
    done = run_checked(llm, prompts, params)
    for i, (prompt, n) in enumerate(cases):
        ours, ref = done[i].outputs[0].token_ids, zoo.hf_greedy(name, prompt, n)
        assert ours == ref, f"request {i} (prompt {len(prompt)} tokens): {divergence(zoo, name, prompt, ours, ref)}"
    return llm


def divergence(zoo, name: str, prompt: list[int], ours: list[int], ref: list[int]) -> str:
    """Where our tokens first leave transformers', and by how much transformers' logit for its own
    token led ours there (a gap near float32 rounding is a near-tie, not a wrong kernel)."""
    import torch

    at = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    if at == len(ours) or at == len(ref):
        return f"lengths differ ({len(ours)} vs {len(ref)} tokens)"
    with torch.inference_mode():
        logits = zoo.hf_model(name)(torch.tensor([prompt + ref[:at]])).logits[0, -1]
    return f"token {at}: ours {ours[at]}, transformers {ref[at]}, logit gap {float(logits[ref[at]] - logits[ours[at]]):.3g}"


@pytest.mark.parametrize(
    "name,block_size",
    [("llama-gqa", 16), ("llama-gqa", 7), ("llama-mha", 16), ("llama-tied", 16), ("llama3-rope", 7),
     ("mistral", 16), ("qwen2", 16), ("qwen3", 7)],
)
def test_greedy_parity_24_concurrent_requests(zoo, name, block_size):
    cases = random_prompts(seed=1, count=24, max_len=400, vocab=VOCAB, max_new=200)
    assert_parity(zoo, name, cases, block_size=block_size, num_gpu_blocks=2048)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_parity_under_preemption(zoo, mode):
    cases = random_prompts(seed=2, count=24, max_len=120, vocab=VOCAB, max_new=80)
    llm = assert_parity(
        zoo, "llama-gqa", cases, block_size=7, num_gpu_blocks=60, num_cpu_blocks=200, preemption_mode=mode,
        max_num_batched_tokens=256,
    )
    assert llm.engine.scheduler.stats.num_preemptions > 0


def test_greedy_parity_with_prefix_cache_hits(zoo):
    system = [11 + (i * 7) % 400 for i in range(150)]
    cases = [(system + p, n) for p, n in random_prompts(seed=4, count=24, max_len=60, vocab=VOCAB, max_new=40)]
    llm = assert_parity(zoo, "qwen2", cases, block_size=16, num_gpu_blocks=2048, max_num_batched_tokens=512)
    stats = llm.engine.scheduler.stats
    assert stats.prefix_hit_tokens >= 20 * 144, stats  # most requests reuse the 9 full system blocks


def test_greedy_parity_with_chunked_prefill(zoo):
    cases = random_prompts(seed=5, count=24, max_len=400, vocab=VOCAB, max_new=60)
    assert_parity(zoo, "llama-gqa", cases, block_size=16, num_gpu_blocks=2048, max_num_batched_tokens=37)


def test_every_fork_of_a_greedy_n_request_matches(zoo):
    cases = random_prompts(seed=6, count=8, max_len=100, vocab=VOCAB, max_new=50)
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", block_size=7, num_gpu_blocks=1024)
    params = [SamplingParams(temperature=0.0, max_tokens=n, n=3) for _, n in cases]
    done = run_checked(llm, [p for p, _ in cases], params)
    for i, (prompt, n) in enumerate(cases):
        ref = zoo.hf_greedy("llama-gqa", prompt, n)
        assert [o.index for o in done[i].outputs] == [0, 1, 2]
        assert all(o.token_ids == ref for o in done[i].outputs)


def test_generate_api_order_text_and_progress_off(zoo):
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=512)
    prompts = ["The quick brown fox", "Memory is cut into fixed-size frames", "A"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == llm.tokenizer.encode(prompt)
        completion = out.outputs[0]
        assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert completion.finish_reason in ("stop", "length")
    chat = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    assert chat.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert chat.outputs[0].token_ids == zoo.hf_greedy("llama-gqa", chat.prompt_token_ids, 12)[: len(chat.outputs[0].token_ids)]
    assert chat.outputs[0].text == llm.tokenizer.decode(chat.outputs[0].token_ids, skip_special_tokens=True)


HALF_TOLERANCE = {"bfloat16": 0.05, "float16": 0.01}  # logit gap that still counts as a tie


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_follows_transformers_in_the_same_dtype(zoo, dtype):
    """Every greedy token is transformers' argmax given the same prefix (teacher-forced, same
    dtype), or within a rounding-sized gap of it: half precision matmuls of other shapes (a batch,
    one token against a whole prompt) round differently, so a near-tie may flip; float32 is the
    exact-parity test."""
    import torch
    from transformers import AutoModelForCausalLM

    llm = LLM(zoo.path("qwen3"), device="cpu", dtype=dtype, num_gpu_blocks=256)
    prompts = [[20, 30, 40], list(range(50, 90))]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(zoo.path("qwen3"), dtype=getattr(torch, dtype)).eval()
    exact = 0
    for prompt, out in zip(prompts, outs):
        ours = out.outputs[0].token_ids
        assert len(ours) == 24
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1 : -1].float()
        best = logits.argmax(dim=-1)
        gaps = logits.gather(1, best[:, None])[:, 0] - logits[torch.arange(len(ours)), torch.tensor(ours)]
        assert float(gaps.max()) <= HALF_TOLERANCE[dtype], (gaps.max(), ours)
        exact += int((best == torch.tensor(ours)).sum())
    assert exact >= 0.9 * 48  # near-ties are rare


def test_a_hash_collision_is_a_miss_never_another_prompts_kv(zoo, monkeypatch):
    """Every block hashes alike (the hash patched to a constant): a second prompt whose blocks
    collide with the first's cached ones must not be served their KV; its key (the tokens) is
    checked on every hit, so it misses and is computed, and its output stays transformers'."""
    from pagedserve.shared import block_hash as hashing
    from pagedserve.worker.core.kv_cache import block_manager

    monkeypatch.setattr(hashing, "block_hash", lambda *_: 12345)
    monkeypatch.setattr(block_manager, "block_hash", lambda *_: 12345)
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", seed=0, block_size=8, num_gpu_blocks=64)
    first, second = [11 + i for i in range(40)], [300 - i for i in range(40)]
    run_checked(llm, [first], [SamplingParams(temperature=0.0, max_tokens=1)])
    assert llm.engine.scheduler.blocks.match_prefix(first).blocks  # the first prompt's blocks are cached
    done = run_checked(llm, [second], [SamplingParams(temperature=0.0, max_tokens=8)])
    assert done[0].outputs[0].token_ids == zoo.hf_greedy("llama-gqa", second, 8)
    assert llm.engine.scheduler.stats.prefix_hit_tokens == 0
