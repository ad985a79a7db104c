"""The numbers the worker exports (``Engine.stats()``, ``worker/core/scheduling/engine_stats.py``) read back
exactly, each from a case where it can be counted by hand: four forks sharing a prompt (blocks
saved by sharing, copy-on-write copies), a prompt asked twice (prefix-cache queries and hits), a
pool too small for its requests (preemptions, swapped requests)."""

from __future__ import annotations

from pagedserve import LLM
from pagedserve.shared.sampling import SamplingParams

BLOCK = 16


def test_forks_count_their_shared_blocks_and_copies(zoo):
    """A 40-token prompt is two full blocks and one holding 8 tokens. Four forks (n=4) share all
    three; each fork's first token goes into the partial block, so three of them copy it (the last
    holder writes in place): 3 copies, and 4 x 3 table entries on 2 + 4 blocks, 6 saved."""
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", seed=0, block_size=BLOCK, num_gpu_blocks=64)
    engine = llm.engine
    engine.add_request("forks", list(range(20, 60)), SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True))
    engine.step()  # the prefill: each fork samples its first token
    engine.step()  # the first decode writes it into the shared partial block
    stats = engine.stats()
    assert (stats["cow_copies_total"], stats["kv_blocks_saved_by_sharing"]) == (3, 6)
    assert stats["num_requests_running"] == 1 and stats["kv_cache_usage_perc"] == 6 / 64
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert (stats["kv_blocks_saved_by_sharing"], stats["num_requests_running"], stats["kv_cache_usage_perc"]) == (0, 0, 0)


def test_a_prompt_asked_twice_counts_its_queries_and_hits(zoo):
    """Each prompt's tokens are queries; the second time, its two full blocks are hits (the last
    token is always computed, so a 40-token prompt can hit (40 - 1) // 16 = 2 blocks)."""
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", seed=0, block_size=BLOCK, num_gpu_blocks=64)
    prompt = list(range(100, 140))
    for _ in range(2):
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    stats = llm.engine.stats()
    assert (stats["prefix_cache_queries_total"], stats["prefix_cache_hits_total"]) == (80, 32)


def test_a_pool_too_small_counts_preemptions_and_swapped_requests(zoo):
    """Twelve blocks for four requests that each grow to 3 blocks and beyond: some must leave the
    GPU; in swap mode the ones swapped out show as swapped while they wait, and every preemption
    is counted once, as the scheduler's own count says."""
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", seed=0, block_size=BLOCK, num_gpu_blocks=12,
              num_cpu_blocks=64, preemption_mode="swap")
    engine = llm.engine
    for i in range(4):
        engine.add_request(str(i), [30 + i] * 20, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    swapped_seen = 0
    while engine.has_unfinished():
        engine.step()
        stats = engine.stats()
        assert stats["num_requests_swapped"] == len(engine.scheduler.swapped)
        swapped_seen = max(swapped_seen, stats["num_requests_swapped"])
    assert swapped_seen >= 1
    assert engine.stats()["num_preemptions_total"] == engine.scheduler.stats.num_preemptions > 0
