"""Tensor parallel on the CPU (gloo, two processes): greedy output at TP=2 equals TP=1 token for
token on the parity families (Llama with 2 KV heads, MHA, one KV head replicated with tied
embeddings, Qwen2's biases, a MoE with a shared expert, Mixtral), under preemption (recompute and
swap), copy-on-write forks and prefix-cache hits, block invariants checked every step; a model
whose heads do not divide, and what TP does not combine with, are clear errors before any rank
starts; a rank killed mid-run ends the engine's next step with a device failure, never a hang."""

from __future__ import annotations

import os
import signal

import pytest

from pagedserve import LLM
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.offline_outputs import prompt_token_logprobs
from pagedserve.worker.runner.device.failures import DeviceFailure
from pagedserve.worker.runner.parallel.shard import ShardError
from pagedserve import LoRARequest
from tests.conftest import random_prompts
from tests.lora_helpers import ALL_TARGETS, make_adapter
from tests.engine.test_parity import VOCAB, run_checked

SYSTEM = [11 + (i * 7) % 400 for i in range(40)]  # a shared prefix: 2 full blocks of 16 reused


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    cases = random_prompts(seed=40, count=10, max_len=90, vocab=VOCAB, max_new=50)
    prompts = [p for p, _ in cases] + [SYSTEM + p for p, _ in cases[:4]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, n=2 if i % 3 == 0 else 1)
              for i, (_, n) in enumerate(cases + cases[:4])]
    return prompts, params


def run(zoo, name: str, tp: int, **kwargs) -> tuple[list[list[list[int]]], dict]:
    """Every request's outputs' tokens, and what the engine went through (preemptions, swaps, hits)."""
    kwargs.setdefault("num_gpu_blocks", 28)
    llm = LLM(zoo.path(name), device="cpu", dtype="float32", seed=0, block_size=16, max_num_batched_tokens=96,
              tensor_parallel_size=tp, **kwargs)
    seen = {"swapped": 0}

    def note(engine) -> None:
        seen["swapped"] = max(seen["swapped"], len(engine.scheduler.swapped))

    try:
        prompts, params = workload()
        done = run_checked(llm, prompts, params, note)
        stats = llm.engine.stats()
    finally:
        llm.engine.close()
    return [[o.token_ids for o in done[i].outputs] for i in range(len(prompts))], {**stats, **seen}


@pytest.mark.parametrize("name, tp, mode", [
    ("llama-gqa", 2, "recompute"), ("llama-mha", 2, "swap"), ("llama-tied", 2, "recompute"), ("qwen2", 2, "swap"),
    ("qwen2-moe", 2, "recompute"), ("mixtral", 2, "swap"), ("phi3", 2, "recompute"),  # phi3: fused checkpoint tensors
    ("llama-gqa", 4, "recompute"),  # 2 KV heads over 4 ranks: each replicated on the two ranks whose q heads read it
    ("gemma3", 2, "swap"),  # lanes: each rank keeps every lane's tables from the plans' changes alone
])
def test_tp_greedy_equals_tp1_under_preemption_forks_and_prefix_hits(zoo, name, tp, mode):
    blocks = {"gemma3": 100}.get(name, 28)  # six lanes of a layer: a little more than a request's worst case
    one, one_stats = run(zoo, name, 1, preemption_mode=mode, num_gpu_blocks=blocks)
    two, two_stats = run(zoo, name, tp, preemption_mode=mode, num_gpu_blocks=blocks)
    for i, (a, b) in enumerate(zip(one, two)):
        assert a == b, f"request {i}: TP=1 {a} vs TP={tp} {b}"
    assert two_stats["num_preemptions_total"] > 0 and two_stats["prefix_cache_hits_total"] >= 32, two_stats  # the shared prefix reused at least once
    assert two_stats["cow_copies_total"] > 0, two_stats  # the forks wrote their shared last block
    if mode == "swap":
        assert two_stats["swapped"] > 0, two_stats


def test_heads_that_do_not_divide_are_a_clear_error_before_any_rank_starts(zoo):
    with pytest.raises(ShardError, match=r"cannot be split over 3 ranks.*4 attention heads"):
        LLM(zoo.path("llama-gqa"), device="cpu", tensor_parallel_size=3)


@pytest.mark.parametrize("kwargs, named", [(dict(kv_offload_dir="/tmp/kv"), "disk KV tier"),
                                           (dict(simulate="0,0,0"), "simulate")])
def test_what_tp_does_not_combine_with_is_refused(zoo, kwargs, named):
    with pytest.raises(ValueError, match=f"does not combine with.*{named}"):
        LLM(zoo.path("llama-gqa"), device="cpu", tensor_parallel_size=2, **kwargs)


def test_a_rank_killed_mid_run_fails_the_next_step_as_a_device_failure(zoo):
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", tensor_parallel_size=2, num_gpu_blocks=64)
    engine = llm.engine
    try:
        engine.add_request("a", list(range(20, 60)), SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        engine.step()
        follower = engine.ranks.processes[0]
        os.kill(follower.pid, signal.SIGKILL)
        follower.wait(10)
        with pytest.raises(DeviceFailure, match=r"tensor-parallel rank 1 \(pid \d+\) exited with code -9"):
            for _ in range(50):
                engine.step()
    finally:
        engine.close()


def test_lora_adapters_under_tp2_give_the_tp1_tokens_mixed_preempted_and_loaded_at_run_time(zoo, tmp_path):
    """Each rank holds its part of every adapter (a column-parallel layer's B by rows, a row-parallel
    one's A by columns); two adapters and the base model in one batch under preemption, then a third
    adapter loaded at run time (read by rank 0, then by the others) and one unloaded."""
    specs = {"all8": (8, ALL_TARGETS), "some16": (16, ["q_proj", "v_proj", "o_proj", "down_proj"]),
             "late4": (4, ["k_proj", "up_proj", "down_proj"])}
    for seed, (name, (rank, targets)) in enumerate(specs.items()):
        make_adapter(zoo, "llama-gqa", tmp_path / name, rank, targets, seed=seed)
    prompts = [[10 + i, 20 + 3 * i, 7, 300 + i] * (3 + i % 4) for i in range(9)]
    names = [None, "all8", "some16"] * 3
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def outputs(tp: int) -> tuple[list, list, list]:
        llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=10, enable_lora=True,
                  max_loras=2, tensor_parallel_size=tp, lora_modules=(f"all8={tmp_path / 'all8'}",))
        try:
            requests = [None if n is None else LoRARequest(n, 1, str(tmp_path / n)) for n in names]
            mixed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=requests, use_tqdm=False)]
            assert llm.engine.stats()["num_preemptions_total"] > 0
            llm.engine.load_adapter("late4", str(tmp_path / "late4"))
            llm.engine.unload_adapter("some16")
            late = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], params, lora_request=LoRARequest(
                "late4", 2, str(tmp_path / "late4")), use_tqdm=False)]
            base = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], params, use_tqdm=False)]
        finally:
            llm.engine.close()
        return mixed, late, base

    one, two = outputs(1), outputs(2)
    assert two == one
    assert len({tuple(t) for t in one[0][:3]}) == 3 and one[1] != one[2]  # the adapters change the answers


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_under_tp2_keeps_the_plain_tokens(zoo, method):
    """Drafts from the prompt (the scheduler's) or from a draft model (rank 0 alone runs it, and the
    plan goes out with its drafts in): the greedy tokens are the engine's without speculation."""
    path = zoo.path("llama-gqa")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1} \
        if method == "ngram" else {"model": str(path), "num_speculative_tokens": 3}
    prompts = [[10 + i % 7 for i in range(40)] * 2, [30, 31, 32, 33] * 10, list(range(50, 90))]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = LLM(path, device="cpu", dtype="float32", num_gpu_blocks=64)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, device="cpu", dtype="float32", num_gpu_blocks=64, tensor_parallel_size=2, speculative_config=spec)
    try:
        got = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]  # one stream drafts freely
        accepted = sum(llm.engine.spec_counts())
        # bytes per token over both ranks: each holds half the target's heads, rank 0 alone the draft (the target itself)
        assert llm.engine.kv_bytes_per_token == (2 if method == "draft" else 1) * plain.engine.kv_bytes_per_token
    finally:
        llm.engine.close()
    assert got == want
    assert accepted > 0  # drafts were made and kept (else nothing was tested)


def test_prefixes_evicted_to_the_host_tier_come_back_under_tp2(zoo):
    """Each rank keeps its part of every host slot; the moves go by slot and block id, so a prefix
    the pool evicted comes back from the host tier on every rank and the tokens are TP=1's."""
    from tests.engine.test_kv_tiers_engine import GREEDY, prompts

    def run(tp: int) -> tuple[list, dict]:
        llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=12, block_size=16,
                  num_host_blocks=32, tensor_parallel_size=tp)
        try:
            batch = prompts()
            tokens = [run_checked(llm, [p], [GREEDY])[0].outputs[0].token_ids for p in batch + batch]
            return tokens, llm.engine.stats()
        finally:
            llm.engine.close()

    (one, _), (two, stats) = run(1), run(2)
    assert two == one
    assert stats["kv_tier_hit_tokens_total"] >= 4 * 4 * 16  # the second round: four full blocks of each prompt from the host


def test_beam_search_prompt_logprobs_and_seeded_samples_under_tp2_are_tp1s(zoo):
    """What only rank 0 does with the gathered logits (beam steps, prompt logprobs, seeded draws)
    gives TP=1's answers; logprobs equal up to the sums' order."""
    prompts = [[20 + i for i in range(30)], [77, 78, 79, 80] * 6]
    params = [SamplingParams(max_tokens=8, use_beam_search=True, beam_width=3, temperature=0.0),
              SamplingParams(max_tokens=8, temperature=0.7, seed=5, n=2, prompt_logprobs=2, logprobs=1)]

    def run(tp: int) -> list:
        llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=64, tensor_parallel_size=tp)
        try:
            return llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.engine.close()

    one, two = run(1), run(2)
    for a, b in zip(one, two):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    prompt_one, prompt_two = prompt_token_logprobs(one[1]), prompt_token_logprobs(two[1])
    assert len(prompt_one) == len(prompts[1]) - 1 and prompt_two == pytest.approx(prompt_one, abs=1e-4)


def test_structured_outputs_under_tp2_match_and_equal_tp1(zoo):
    """The grammar lives on rank 0 (the plan goes out without it): the masked greedy tokens are TP=1's."""
    import re

    from pagedserve.shared.structured import StructuredOutputs

    regex = r"[a-z]{3,8}-\d{2,4}"
    params = SamplingParams(max_tokens=16, temperature=0.0, structured=StructuredOutputs(regex=regex))

    def run(tp: int) -> list[str]:
        llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=64, tensor_parallel_size=tp)
        try:
            return [o.outputs[0].text for o in llm.generate([[5, 6, 7], [40, 41]], params, use_tqdm=False)]
        finally:
            llm.engine.close()

    one, two = run(1), run(2)
    assert two == one and all(re.fullmatch(regex, text) for text in two), (one, two)
