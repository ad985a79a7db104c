"""The engine on an 8-bit KV cache: lossy by design, so the reference is the same engine and cache
format serving one request at a time. Batched, under preemption (recompute and swap), with forks
and prefix-cache hits, every request gets those tokens: the engine adds nothing to the cache's
error. Block invariants hold after every step; the pool holds the blocks its bytes allow."""

from __future__ import annotations

import pytest

from pagedserve import LLM
from pagedserve.shared.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.engine.test_parity import run_checked

CASES = random_prompts(seed=11, count=16, max_len=120, vocab=512, max_new=40)


def alone(zoo, kv: str) -> list[list[int]]:
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", kv_cache_dtype=kv, block_size=7,
              num_gpu_blocks=512, enable_prefix_caching=False)
    return [llm.generate([p], SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False)[0].outputs[0].token_ids
            for p, n in CASES]


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_batched_preempted_forked_and_cached_equals_one_at_a_time(zoo, kv, mode):
    expected = alone(zoo, kv)
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", kv_cache_dtype=kv, block_size=7, num_gpu_blocks=48,
              num_cpu_blocks=200, preemption_mode=mode, max_num_batched_tokens=128)
    prompts = [p for p, _ in CASES]
    params = [SamplingParams(temperature=0.0, max_tokens=n, n=2) for _, n in CASES]  # forks share the prompt
    first = run_checked(llm, prompts, params)
    stats = llm.engine.scheduler.stats
    assert stats.num_preemptions > 0
    for i, tokens in enumerate(expected):
        assert [c.token_ids for c in first[i].outputs] == [tokens, tokens], f"request {i}"
    last = [i for i in first if len(prompts[i]) >= 14][-3:]  # finished last: their blocks are still cached
    again = run_checked(llm, [prompts[i] for i in last], [params[i] for i in last])
    if mode == "recompute":  # swapped-in blocks come back unhashed (worker/core/kv_cache/block_manager.py): no hits there
        assert stats.prefix_hit_tokens > 0  # hits on the quantized blocks
    for j, i in enumerate(last):
        assert [c.token_ids for c in again[j].outputs] == [expected[i]] * 2, f"request {i} again"


def test_the_pool_holds_what_its_bytes_allow(tmp_path):
    """One KV budget, heads of 64 (as SmolLM2's and most models'): an 8-bit cache (64 codes and a
    2-byte scale per row) holds 1.94x the blocks of a bfloat16 one and 3.88x those of a float32 one."""
    from pagedserve.worker.source.demo_model import build_model

    model = build_model(tmp_path / "heads-of-64", hidden_size=128, num_heads=2, num_kv_heads=1)
    budget = 8 << 20
    blocks = {}
    for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "int8"), ("bfloat16", "fp8")):
        llm = LLM(model, device="cpu", dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=budget)
        blocks[(dtype, kv)] = llm.engine.scheduler.config.num_gpu_blocks
        pool = llm.engine.runner.kv_pool
        assert pool.numel() * pool.element_size() <= budget
    assert blocks[("float32", "int8")] == blocks[("bfloat16", "fp8")]
    assert blocks[("float32", "int8")] / blocks[("bfloat16", "auto")] >= 1.9
    assert blocks[("float32", "int8")] / blocks[("float32", "auto")] >= 3.8
