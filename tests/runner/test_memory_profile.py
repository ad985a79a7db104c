"""KV pool sizing: the worst-case step the profile runs, and the budget arithmetic."""

import torch

from pagedserve import LLM
from pagedserve.kernels.kv_format import AUTO
from pagedserve.kernels.ops import reference_ops
from pagedserve.worker.engine_config import EngineConfig
from pagedserve.worker.runner.beam_search import BeamSearcher
from pagedserve.worker.runner.memory_profile import profile_blocks_needed, worst_case_step
from pagedserve.worker.runner.model_runner import ModelRunner
from pagedserve.worker.runner.sampler import Sampler


def test_the_worst_case_step_runs_within_its_scratch_pool(zoo):
    """The profile's dummy step (the CUDA sizing runs exactly this) fits the pool it is given."""
    engine = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=16).engine
    model, cpu = engine.runner.model, torch.device("cpu")
    blocks = profile_blocks_needed(300, 128, 16)
    assert blocks == 8
    runner = ModelRunner(model, reference_ops(), cpu, torch.float32, AUTO, 16, blocks, 0, Sampler(frozenset()), BeamSearcher(frozenset()))
    worst_case_step(runner, max_num_batched_tokens=300, max_num_seqs=9, max_model_len=128, vocab=model.config.vocab_size)
    assert runner.kv_pool.abs().sum() > 0  # the chunks wrote their K/V


def test_the_cuda_budget_leaves_room_for_the_step():
    config = EngineConfig(model="m", gpu_memory_utilization=0.5)
    gib = 2**30
    # 80 GiB device, 10 GiB in use (weights, context), a 2 GiB step: 40 - 10 - 2 = 28 GiB of blocks.
    assert config.gpu_blocks(gib, free_bytes=70 * gib, on_cuda=True, total_bytes=80 * gib, step_peak_bytes=2 * gib) == 28
    assert EngineConfig(model="m", num_gpu_blocks=5).gpu_blocks(gib, 0, True, 80 * gib, 2 * gib) == 5
    assert not EngineConfig(model="m", kv_cache_memory=gib).sizes_pool_from_memory
