"""The CUDA graphs' static buffers, on the CPU (what a replay reads is what ``_load`` leaves in
them): padding rows of a smaller step never read a block a larger step left behind, and the
metadata a graph replays gives rope the lengths the eager step gives it."""

from __future__ import annotations

import torch

from pagedserve import LLM
from pagedserve.worker.core.scheduling.plan import ScheduledSeq
from pagedserve.worker.runner.attention.kept_tables import KeptTables
from pagedserve.worker.runner.attention.step_inputs import step_inputs
from pagedserve.worker.runner.device.cuda_graphs import DecodeGraphs, GraphLimits, _Bucket

CPU = torch.device("cpu")


def decode_row(seq_id: int, table: tuple[int, ...], start: int, seq_len: int = 0, num_samples: int = 1) -> ScheduledSeq:
    return ScheduledSeq(seq_id, str(seq_id), (20 + seq_id,), start, table, num_samples, seq_len=seq_len)


def test_padding_rows_read_block_zero_after_a_larger_step():
    graphs = DecodeGraphs(None, None, CPU, 4, GraphLimits(max_model_len=64, max_num_seqs=4))
    bucket = _Bucket(4, graphs.contexts[-1], graphs.block_size, CPU)
    released = -1  # worker/core/block_tables.NO_BLOCK: a sliding-window row's first blocks, released
    rows = [decode_row(i, (released, 5 + i, 9 + i), start=10) for i in range(3)]
    graphs._load(bucket, rows, KeptTables.of(rows))
    assert bucket.tables[:3, 0].tolist() == [released] * 3
    rows = [decode_row(7, (3,), start=2)]
    graphs._load(bucket, rows, KeptTables.of(rows))
    assert bucket.tables[:, 0].tolist() == [3, 0, 0, 0]  # padding rows attend over block 0
    assert bucket.lens.tolist() == [3, 1, 1, 1] and bucket.slots.tolist()[1:] == [-1, -1, -1]


def test_a_graph_gives_rope_the_eager_steps_lengths(zoo):
    """A one-token chunk of a longer prompt (not its last) runs in a decode graph; dynamic NTK
    rotates it by the prompt's length there as eagerly, not by its context's."""
    runner = LLM(zoo.path("llama-dynamic"), device="cpu", dtype="float32", num_gpu_blocks=64).engine.runner
    assert runner.model.rotary.needs_seq_lens
    items = [decode_row(0, (1, 2, 3), start=9, seq_len=40, num_samples=0), decode_row(1, (4, 5), start=17)]
    eager = step_inputs(items, runner.block_size, CPU, runner.model.rotary.needs_seq_lens).meta
    graphs = DecodeGraphs(runner.model, runner.kv_caches, CPU, runner.block_size, GraphLimits(64, 4))
    bucket = _Bucket(2, graphs.contexts[-1], graphs.block_size, CPU)
    graphs._load(bucket, items, KeptTables.of(items))
    replayed = graphs._metadata(bucket)
    assert replayed.token_seq_lens.tolist() == eager.token_seq_lens.tolist() == [40, 18]
    assert replayed.decode_seq_lens.tolist() == eager.decode_seq_lens.tolist() == [10, 18]


def test_context_buckets_grow_fourfold_from_2048_to_the_models_length():
    from pagedserve.worker.runner.device.cuda_graphs import context_buckets

    assert context_buckets(64) == (64,)
    assert context_buckets(2048) == (2048,)
    assert context_buckets(4096) == (2048, 4096)
    assert context_buckets(10000) == (2048, 8192, 10000)
    assert context_buckets(131072) == (2048, 8192, 32768, 131072)


def test_a_decode_step_replays_the_graph_of_its_batch_and_longest_context():
    """The graph is picked by the step's size and its longest context, and launches the decode
    kernel for that context bucket, not for the model's whole length (256 slices at 128k)."""
    graphs = DecodeGraphs(None, None, CPU, 16, GraphLimits(max_model_len=131072, max_num_seqs=256))
    rows = [decode_row(0, (1,) * 7, start=99), decode_row(1, (2,) * 188, start=2999), decode_row(2, (3,) * 4, start=49)]
    assert graphs.key(rows) == (4, 1, 8192)
    assert graphs.key([decode_row(0, (1,) * 8192, start=131071)]) == (1, 1, 131072)
    assert graphs.key([decode_row(0, (1,), start=2047)]) == (1, 1, 2048)  # a context of exactly 2,048
    bucket = _Bucket(4, 8192, 16, CPU)
    assert bucket.tables.shape == (4, 512)  # 8,192 tokens of blocks of 16, not 131,072
    meta = graphs._metadata(bucket)
    assert meta.decode_max_seq_len == 8192 and meta.prefill_block_tables.shape == (0, 512)
    graphs._load(bucket, rows, KeptTables.of(rows))
    assert bucket.lens.tolist() == [100, 3000, 50, 1]


def test_every_decode_variant_is_warmed_for_each_window(zoo):
    """At start on CUDA the runner launches the decode kernel once per variant a step can need: one
    per window and score cap the layers use (the slices' size and count are run-time values, never
    compiled in); here the launches are recorded."""
    import dataclasses

    runner = LLM(zoo.path("gemma2"), device="cpu", dtype="float32", num_gpu_blocks=16).engine.runner
    launched = []
    runner.ops = dataclasses.replace(runner.ops, decode=lambda q, k, v, t, lens, scale, max_seq_len, **extra:
                                     launched.append((max_seq_len, extra, q.dtype, q.device.type)))
    runner.warm_decode(3000)
    extras = sorted({tuple(sorted(layer.self_attn.attn.extra.items())) for layer in runner.model.model.layers})
    assert len(extras) == 2  # gemma 2: sliding and full layers alternate, every score capped
    assert launched == [(3000, dict(extra), torch.float32, "cpu") for extra in extras]
    drafting = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=16,
                   speculative_config={"model": str(zoo.path("llama-mha")), "num_speculative_tokens": 2}).engine.runner
    shapes = []
    drafting.ops = dataclasses.replace(drafting.ops, decode=lambda q, k, v, t, lens, scale, max_seq_len, **extra:
                                       shapes.append((tuple(q.shape), tuple(k.shape[1:]), max_seq_len)))
    drafting.warm_decode(600)  # the target's variant, then the draft's (its own heads and pool)
    target, draft = drafting.model.model.layers[0].self_attn, drafting.drafter.model.model.layers[0].self_attn
    assert shapes == [((1, a.num_heads, a.head_dim), tuple(pool[0][0].shape[1:]), 600)
                      for a, pool in ((target, drafting.kv_caches), (draft, drafting.drafter.kv_caches))]


def test_steps_checking_drafts_replay_a_graph_of_their_draft_length_bucket():
    """With n drafts a row, graphs hold rows of 1 + (1, 2, 4, ..., n) token places; a step takes the
    narrowest its longest row fits, while its rows' places stay within max_num_seqs tokens."""
    from pagedserve.worker.runner.device.cuda_graphs import draft_widths

    assert draft_widths(0) == (1,) and draft_widths(1) == (1, 2)
    assert draft_widths(4) == (1, 2, 3, 5) and draft_widths(5) == (1, 2, 3, 5, 6)
    graphs = DecodeGraphs(None, None, CPU, 16, GraphLimits(max_model_len=4096, max_num_seqs=16, max_draft=4))

    def row(seq_id: int, drafts: int) -> ScheduledSeq:
        return ScheduledSeq(seq_id, str(seq_id), (1,) * (1 + drafts), 2999, (2,) * 188, 1, num_draft=drafts)

    assert graphs.key([row(0, 2), row(1, 0), row(2, 1)]) == (4, 3, 4096)
    assert graphs.key([row(0, 3)]) == (1, 5, 4096)
    assert graphs.can_run([row(i, 4) for i in range(3)])  # 3 rows of 5 places: 15 tokens
    assert not graphs.can_run([row(i, 4) for i in range(4)])  # 20 tokens: eagerly
    assert not graphs.can_run([ScheduledSeq(0, "0", (1,) * 6, 0, (2,), 1)])  # a chunk of 6 tokens
    one = DecodeGraphs(None, None, CPU, 16, GraphLimits(max_model_len=4096, max_num_seqs=1, max_draft=4))
    assert one.can_run([row(0, 4)])  # one row of drafts at least, whatever max_num_seqs


def test_a_rows_padding_reads_block_zero_past_its_blocks_after_a_longer_step():
    """Rows of drafts: a row whose padding passes its own blocks reads block 0 there, not the entry an
    earlier step's longer row left in the bucket's table; its padding writes nothing."""
    graphs = DecodeGraphs(None, None, CPU, 4, GraphLimits(max_model_len=64, max_num_seqs=8, max_draft=3))
    bucket = _Bucket(2, 64, 4, CPU, width=4)
    longer = [ScheduledSeq(0, "0", (1, 2), 10, (9, 9, 9, 9), 1, num_draft=1)]
    graphs._load(bucket, longer, KeptTables.of(longer))
    assert bucket.tables[0, :4].tolist() == [9, 9, 9, 9]
    short = [ScheduledSeq(1, "1", (1,), 2, (5,), 1)]  # context 3: its padding reaches positions 3-5, block entry 1
    assert graphs._load(bucket, short, KeptTables.of(short))[0] == [0]
    assert bucket.tables[0, :2].tolist() == [5, 0] and bucket.lens.tolist() == [6, 4]
    assert bucket.slots.tolist() == [4 * 5 + 2] + [-1] * 7 and bucket.positions.tolist()[:4] == [2, 2, 2, 2]
