"""KV pool sizing: the worst-case step the profile runs, and the budget arithmetic."""

import torch

from pagedserve import LLM
from pagedserve.kernels.kv_format import AUTO
from pagedserve.kernels.ops import reference_ops
from pagedserve.worker.runner.device.memory_profile import profile_blocks_needed, worst_case_step
from pagedserve.worker.runner.model_runner import ModelRunner
from pagedserve.worker.runner.sampling.beam_search import BeamSearcher
from pagedserve.worker.runner.sampling.sampler import Sampler
from pagedserve.worker.setup.engine_config import EngineConfig


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


def llama3_8b():
    """The shapes that matter here of a Llama-3-8B config (no weights)."""
    from types import SimpleNamespace

    return SimpleNamespace(num_attention_heads=32, head_dim=128, hidden_size=4096, intermediate_size=14336,
                           vocab_size=128256)


def test_the_pool_leaves_room_for_a_long_decode_and_the_graphs():
    """At 256 sequences and a 128k context an eager decode step's partials (about 1 GiB) outweigh a
    small profiled step, and the decode graphs' pool comes on top when they are captured."""
    from pagedserve.kernels.decode_partitions import decode_scratch_bytes
    from pagedserve.worker.runner.device.cuda_graphs import GraphLimits, graph_pool_bytes
    from pagedserve.worker.runner.device.memory_profile import reserved_beside_pool

    config, gib = llama3_8b(), 2**30
    decode = decode_scratch_bytes(256, 32, 128, 131072)
    assert decode == 256 * 32 * 256 * 130 * 4  # 256 slices of 512 tokens, float32 rows of 128 + max + sum
    graphs = graph_pool_bytes(GraphLimits(131072, 256), config, 2)
    assert decode < graphs < 2 * gib  # the partials, activations and 256 rows of logits
    assert graph_pool_bytes(GraphLimits(131072, 256, max_draft=4), config, 2) == graphs  # drafts: within max_num_seqs
    one_row = graph_pool_bytes(GraphLimits(4096, 1, max_draft=4), config, 2)
    assert one_row == graph_pool_bytes(GraphLimits(4096, 5), config, 2)  # a row of 5 places
    assert reserved_beside_pool(gib // 2, config, GraphLimits(131072, 256), 2, graphs=False) == decode
    assert reserved_beside_pool(gib // 2, config, GraphLimits(131072, 256), 2, graphs=True) == decode + graphs
    assert reserved_beside_pool(3 * gib, config, GraphLimits(4096, 256), 2, graphs=False) == 3 * gib  # the profile's step is larger
    # and the budget arithmetic takes it out of the blocks: 80 GiB at 0.9, 17 GiB in use
    engine = EngineConfig(model="m")
    reserved = reserved_beside_pool(gib // 2, config, GraphLimits(131072, 256), 2, True)
    with_graphs = engine.gpu_blocks(gib, 63 * gib, True, 80 * gib, reserved)
    assert with_graphs == int(0.9 * 80 * gib - 17 * gib - decode - graphs) // gib
