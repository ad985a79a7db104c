"""The CUDA graphs' static buffers, on the CPU (what a replay reads is what ``_load`` leaves in
them): padding rows of a smaller step never read a block a larger step left behind, and the
metadata a graph replays gives rope the lengths the eager step gives it."""

from __future__ import annotations

import torch

from pagedserve import LLM
from pagedserve.worker.core.plan import ScheduledSeq
from pagedserve.worker.runner.cuda_graphs import DecodeGraphs, GraphLimits, _Bucket

CPU = torch.device("cpu")


def decode_row(seq_id: int, table: tuple[int, ...], start: int, seq_len: int = 0, num_samples: int = 1) -> ScheduledSeq:
    return ScheduledSeq(seq_id, str(seq_id), (20 + seq_id,), start, table, num_samples, seq_len=seq_len)


def test_padding_rows_read_block_zero_after_a_larger_step():
    graphs = DecodeGraphs(None, None, CPU, 4, GraphLimits(max_model_len=64, max_num_seqs=4))
    bucket = _Bucket(4, graphs.max_blocks, CPU)
    released = -1  # worker/core/block_manager.NO_BLOCK: a sliding-window row's first blocks, released
    graphs._load(bucket, [decode_row(i, (released, 5 + i, 9 + i), start=10) for i in range(3)])
    assert bucket.tables[:3, 0].tolist() == [released] * 3
    graphs._load(bucket, [decode_row(7, (3,), start=2)])
    assert bucket.tables[:, 0].tolist() == [3, 0, 0, 0]  # padding rows attend over block 0
    assert bucket.lens.tolist() == [3, 1, 1, 1] and bucket.slots.tolist()[1:] == [-1, -1, -1]


def test_a_graph_gives_rope_the_eager_steps_lengths(zoo):
    """A one-token chunk of a longer prompt (not its last) runs in a decode graph; dynamic NTK
    rotates it by the prompt's length there as eagerly, not by its context's."""
    runner = LLM(zoo.path("llama-dynamic"), device="cpu", dtype="float32", num_gpu_blocks=64).engine.runner
    assert runner.model.rotary.needs_seq_lens
    items = [decode_row(0, (1, 2, 3), start=9, seq_len=40, num_samples=0), decode_row(1, (4, 5), start=17)]
    eager = runner._metadata(items, len(items), [s.slot_mapping(runner.block_size)[0] for s in items])
    graphs = DecodeGraphs(runner.model, runner.kv_caches, CPU, runner.block_size, GraphLimits(64, 4))
    bucket = _Bucket(2, graphs.max_blocks, CPU)
    graphs._load(bucket, items)
    replayed = graphs._metadata(bucket)
    assert replayed.token_seq_lens.tolist() == eager.token_seq_lens.tolist() == [40, 18]
    assert replayed.decode_seq_lens.tolist() == eager.decode_seq_lens.tolist() == [10, 18]
