"""Every tensor names its device: engine steps with ``torch.set_default_device("meta")``.

The engine's own device is the CPU; any tensor created without an explicit device (a forgotten
``device=``) lands on ``meta`` instead and the step fails, as it would mix CPU and CUDA tensors on
a GPU. The workload covers every sampling feature and the block moves (swap preemption, CoW).
"""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM
from pagedserve.shared.sampling import SamplingParams
from pagedserve.shared.structured import StructuredOutputs

FEATURES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    "temperature": SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True),
    "top_k_p": SamplingParams(temperature=1.0, top_k=20, top_p=0.8, max_tokens=12, ignore_eos=True),
    "min_p": SamplingParams(min_p=0.1, max_tokens=12, ignore_eos=True),
    "penalties": SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4,
                                max_tokens=12, ignore_eos=True),
    "seeded": SamplingParams(seed=7, max_tokens=12, ignore_eos=True),
    "logprobs": SamplingParams(logprobs=3, max_tokens=12, ignore_eos=True),
    "min_tokens_stop_ids": SamplingParams(min_tokens=4, stop_token_ids=(40, 41, 42), max_tokens=12),
    "n3": SamplingParams(n=3, temperature=0.9, max_tokens=12, ignore_eos=True),
    "best_of": SamplingParams(n=2, best_of=3, max_tokens=12, ignore_eos=True),
    "structured": SamplingParams(n=2, temperature=1.0, max_tokens=12, structured=StructuredOutputs(regex="[a-z]{3,9}")),
    "beam": SamplingParams(use_beam_search=True, beam_width=3, n=2, temperature=0.0, max_tokens=12, ignore_eos=True),
    "prompt_logprobs": SamplingParams(prompt_logprobs=2, max_tokens=4),
}


@pytest.fixture(scope="module", params=["auto", "int8"])
def tight_llm(zoo, request):
    # 24 blocks of 4 tokens for 13 requests of ~20-tokens prompts: preemption (by swap) is certain.
    # int8: the quantized cache's code table and key rotation are made on first use, inside the step.
    return LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=24, block_size=4, num_cpu_blocks=256,
               preemption_mode="swap", max_num_batched_tokens=64, kv_cache_dtype=request.param)


def test_every_feature_steps_with_no_tensor_on_the_default_device(tight_llm):
    engine = tight_llm.engine
    for i, (name, params) in enumerate(FEATURES.items()):
        engine.add_request(name, [20 + i, *range(30, 45)], params)
    done, moves = {}, {"swap_out": 0, "swap_in": 0, "copies": 0}
    torch.set_default_device("meta")
    try:
        while engine.has_unfinished():
            plan = engine.scheduler.schedule()
            for kind in moves:
                moves[kind] += len(getattr(plan, kind))
            result = engine.runner.execute(plan)
            for out in engine.scheduler.update(plan, result):
                if out.finished:
                    done[out.request_id] = out
    finally:
        torch.set_default_device(None)
    assert set(done) == set(FEATURES)
    assert all(out.error is None for out in done.values())
    assert moves["swap_out"] and moves["swap_in"] and moves["copies"], moves
    assert engine.scheduler.blocks.usage().used == 0


def test_steps_running_ahead_name_their_devices(zoo):
    """``--async-scheduling``: the placeholders' fill, the queued copies to the host and the step
    timer create no tensor on the default device either (swap preemption among the steps)."""
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=24, block_size=4, num_cpu_blocks=256,
              preemption_mode="swap", max_num_batched_tokens=64, async_scheduling=True)
    engine, ahead = llm.engine, []
    real = engine.scheduler.run_ahead
    engine.scheduler.run_ahead = lambda plan: (ahead.append(plan), real(plan))[1]
    runs_ahead = ("greedy", "temperature", "top_k_p", "min_p", "penalties", "seeded", "logprobs", "min_tokens_stop_ids")
    for i, name in enumerate(runs_ahead * 2):
        engine.add_request(f"{name}-{i}", [20 + i, *range(30, 45)], FEATURES[name])
    done = {}
    torch.set_default_device("meta")
    try:
        while engine.has_unfinished():
            done.update((out.request_id, out) for out in engine.step() if out.finished)
    finally:
        torch.set_default_device(None)
    assert len(done) == 2 * len(runs_ahead) and all(out.error is None for out in done.values())
    assert len(ahead) > 10 and engine.scheduler.stats.num_preemptions > 0
