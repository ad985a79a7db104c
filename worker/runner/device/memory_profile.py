"""How much memory one engine step needs beyond the weights, measured once at start on CUDA.

The KV pool takes what is left of ``gpu_memory_utilization`` x the device's memory after the
weights, everything else already resident, and the peak of one worst-case step: a forward over
``max_num_batched_tokens`` prompt tokens, then sampling ``max_num_seqs`` rows with top-k/top-p
(the sort over the vocabulary is the sampler's largest allocation). Without this a large
vocabulary's logits alone (2,048 x 150k floats: 1.2 GB) can run a full pool out of memory.
"""

from __future__ import annotations

from typing import Callable

import torch

from pagedserve.kernels.decode_partitions import decode_scratch_bytes
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.core.scheduling.plan import ScheduledSeq, StepPlan, private_tables
from pagedserve.worker.runner.device.cuda_graphs import GraphLimits, graph_pool_bytes
from pagedserve.worker.runner.sampling.sampler import Sampler, SampleRow


def worst_case_step(runner, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, vocab: int) -> None:
    """Run the largest step the scheduler can plan: prompt chunks filling the token budget (each
    within the model length), then the sampler on ``max_num_seqs`` filtered rows."""
    block_size, seqs, start = runner.block_size, [], 0
    while start < max_num_batched_tokens:
        length = min(max_model_len, max_num_batched_tokens - start)
        blocks, lanes = private_tables(-(-length // block_size), runner.model.kv_layout.num_lanes)
        seqs.append(ScheduledSeq(len(seqs), f"profile-{len(seqs)}", (1,) * length, 0, blocks, 1, lane_tables=lanes))
        start += length
    runner.forward(StepPlan(tuple(seqs), block_size))
    runner.tables.forget(s.request_id for s in seqs)
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=0)
    rows = [SampleRow(params, (), (), 0, 1, 0)] * max_num_seqs
    logits = torch.zeros((max_num_seqs, vocab), dtype=torch.float32, device=runner.device)
    Sampler(frozenset(), device=runner.device).sample(logits, rows)


def reserved_beside_pool(step_peak: int, model_config, limits: GraphLimits, dtype_bytes: int, graphs: bool) -> int:
    """Bytes the KV pool must leave free on CUDA: the larger of the profiled worst-case step (a full
    token budget of prompt) and an eager decode step's attention partials at ``max_num_seqs`` x
    ``max_model_len`` (the profile does not run one), plus the decode graphs' own pool, which stays
    allocated, when they are captured (``cuda_graphs.graph_pool_bytes``)."""
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    decode = decode_scratch_bytes(limits.max_num_seqs, heads, head_dim, limits.max_model_len)
    pool = graph_pool_bytes(limits, model_config, dtype_bytes) if graphs else 0
    return max(step_peak, decode) + pool


def profile_blocks_needed(max_num_batched_tokens: int, max_model_len: int, block_size: int, num_lanes: int = 1) -> int:
    """Pool blocks the worst-case step writes into (each chunk starts at block 0, in every lane)."""
    return -(-min(max_num_batched_tokens, max_model_len) // block_size) * num_lanes


def peak_step_bytes(make_runner: Callable[[int], object], block_size: int, max_num_batched_tokens: int,
                    max_num_seqs: int, max_model_len: int, vocab: int, device: torch.device, num_lanes: int = 1) -> int:
    """CUDA bytes the worst-case step allocates on top of what was resident, its scratch pool
    excluded. ``make_runner(num_blocks)`` builds a runner with a pool of that many blocks; ``num_lanes``:
    the model's lanes of layers (``worker/core/kv_cache/kv_layout.py``)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    runner = make_runner(profile_blocks_needed(max_num_batched_tokens, max_model_len, block_size, num_lanes))
    pool = torch.cuda.memory_allocated(device) - before
    worst_case_step(runner, max_num_batched_tokens, max_num_seqs, max_model_len, vocab)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - pool
    del runner
    torch.cuda.empty_cache()
    return max(0, peak)
