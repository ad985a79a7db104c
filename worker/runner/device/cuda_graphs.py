"""CUDA graphs for decode steps: one graph per batch-size bucket, captured on first use.

A decode step of a small model is mostly kernel-launch overhead; replaying a captured graph
launches everything at once. Each bucket has static input buffers (token ids, positions, slots,
block tables, context lengths) and a static logits output; a step of ``n`` sequences copies its
inputs into the smallest bucket ``>= n`` and replays it. Padding rows write no K/V (slot -1, which
the store kernel skips) and attend over one token of block 0; their logits are dropped.

The graphs need the Triton kernels (the torch reference reads lengths back to the host) and a
fixed launch grid, so the decode kernel is launched for a context bucket: the smallest of
``context_buckets`` (2,048 tokens, then 4x each, up to ``max_model_len``) that holds the step's
longest context (programs past a sequence's length return at once). A graph sized for
``max_model_len`` on every replay launched 256 slices a head at 128k context and kept partials of
about 1 GiB at 256 sequences. A graph is captured per (batch size, context bucket): every batch
size of the smallest bucket at start, largest first (so smaller ones reuse its memory), longer
contexts on first use. All share one memory pool, which ``graph_pool_bytes`` estimates so the KV
pool is sized without it, and write their logits into one buffer of ``max_num_seqs`` rows: a graph
that held its own output kept it allocated in the pool for good, so every later capture took new
memory for its logits (a Llama-3 vocabulary: about 1 GB over the 19 batch sizes of one context
bucket). With LoRA adapters the graphs read their matrices from fixed buffers and
each row's adapter from a slots buffer (``worker/runner/lora/graph_stack.py``): a decode step mixing
adapters, up to ``max_loras`` of them, replays a graph as the base model's does.

With speculative decoding a step checks each row's drafts in one forward (a row of up to
``1 + num_speculative_tokens`` tokens), so graphs are captured per draft-length bucket too: a graph of
``width`` tokens a row (``draft_widths``: one more than 1, 2, 4, ... drafts up to the configured
count) runs the prefill kernel on rows of exactly ``width`` queries, each row's real tokens first and
padding after (token 0 at the row's last position, slot -1, its context extended so the real queries'
causal positions hold; the padding reads block 0 or the row's own blocks, never a stale table entry,
and its logits are dropped). Such a graph is taken up to ``max_num_seqs`` tokens in all (its
buffers and logits stay within what ``graph_pool_bytes`` reserves), captured on first use. Longer
prefill chunks, mixed steps past that and steps wanting every position's logits run eagerly.
``enforce_eager`` turns graphs off.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from pagedserve.kernels.decode_partitions import decode_scratch_bytes
from pagedserve.worker.core.scheduling.plan import ScheduledSeq
from pagedserve.worker.runner.attention.kept_tables import KeptTables
from pagedserve.worker.runner.attention.paged_attention import AttentionMetadata
from pagedserve.worker.runner.device.launched_step import Placeholders
from pagedserve.worker.runner.lora.graph_stack import GraphStack

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
FIRST_CONTEXT = 2048  # the smallest context bucket (4 slices of the decode kernel)
CONTEXT_GROWTH = 4


def context_buckets(max_model_len: int) -> tuple[int, ...]:
    """The context lengths graphs are captured for: 2,048, then 4x each, and ``max_model_len``."""
    buckets, length = [], FIRST_CONTEXT
    while length < max_model_len:
        buckets.append(length)
        length *= CONTEXT_GROWTH
    return (*buckets, max_model_len)


def draft_widths(max_draft: int) -> tuple[int, ...]:
    """Tokens a row of the graphs a step can replay: 1 (a decode), then one more than each draft-length
    bucket (1, 2, 4, ... drafts, and ``max_draft``)."""
    drafts, length = [], 1
    while length < max_draft:
        drafts.append(length)
        length *= 2
    return (1, *(1 + n for n in drafts), 1 + max_draft) if max_draft else (1,)


def graph_pool_bytes(limits: "GraphLimits", config, dtype_bytes: int) -> int:
    """An upper estimate of the graphs' shared memory pool, kept for the worker's life: the largest
    graph's (``max_num_seqs`` tokens, or one row of drafts where that is more, at ``max_model_len``)
    attention partials of one layer (layers run one after another and reuse them), its activations
    (hidden and MLP widths, at the model's dtype and float32) and its logits (the model's dtype and
    the float32 copy)."""
    rows = max(limits.max_num_seqs, 1 + limits.max_draft)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    widths = 4 * config.hidden_size + 3 * config.intermediate_size + 3 * heads * head_dim
    return (decode_scratch_bytes(rows, heads, head_dim, limits.max_model_len) + rows * widths * (dtype_bytes + 4)
            + rows * config.vocab_size * (dtype_bytes + 4))


@dataclass(frozen=True)
class GraphLimits:
    max_model_len: int
    max_num_seqs: int
    max_draft: int = 0  # speculative decoding's num_speculative_tokens (0: none)


class _Bucket:
    """The static buffers of one captured (batch size, tokens a row, context bucket)."""

    def __init__(self, size: int, context: int, block_size: int, device: torch.device, num_lanes: int = 1,
                 width: int = 1) -> None:
        self.size, self.context, self.width = size, context, width
        tokens = size * width
        self.adapter_slots = torch.full((tokens,), -1, dtype=torch.int32, device=device)  # each token's LoRA place (GraphStack)
        # a row's padding reaches width - 1 positions past its context (draft rows, the module's docstring)
        self.max_blocks = -(-(context + width - 1) // block_size)
        self.ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        # each lane's slots and tables (worker/core/kv_cache/kv_layout.py); the first lane's by name
        self.lane_slots = [torch.full((tokens,), -1, dtype=torch.int64, device=device) for _ in range(num_lanes)]
        self.lane_tables = [torch.zeros((size, self.max_blocks), dtype=torch.int32, device=device) for _ in range(num_lanes)]
        self.slots, self.tables = self.lane_slots[0], self.lane_tables[0]
        self.lens = torch.full((size,), width, dtype=torch.int32, device=device)  # each row's context, padding included
        self.seq_lens = torch.ones(tokens, dtype=torch.int32, device=device)  # rope's length: tokens known, computed or not
        self.query_start = torch.arange(0, tokens + 1, width, dtype=torch.int32, device=device)  # rows of width queries
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None


class DecodeGraphs:
    def __init__(self, model, kv_caches, device: torch.device, block_size: int, limits: GraphLimits,
                 adapters: GraphStack | None = None) -> None:
        """``adapters``: LoRA adapters' matrices in the buffers the graphs read (None: no LoRA)."""
        self.model, self.kv_caches, self.device, self.block_size = model, kv_caches, device, block_size
        self.adapters = adapters
        self.max_model_len = limits.max_model_len
        self.sizes = sorted({b for b in BUCKETS if b < limits.max_num_seqs} | {limits.max_num_seqs})
        self.contexts = context_buckets(limits.max_model_len)
        self.widths = draft_widths(limits.max_draft)
        # a row of drafts' graphs hold max_num_seqs tokens at most (one row at least)
        self.max_tokens = max(limits.max_num_seqs, self.widths[-1])
        self._buckets: dict[tuple[int, int, int], _Bucket] = {}
        self._pool = None
        self._logits: torch.Tensor | None = None  # [max_tokens, vocab]: what every graph's replay writes (_capture)

    def can_run(self, items: list[ScheduledSeq]) -> bool:
        if self.adapters is None and any(s.adapter is not None for s in items):
            return False
        if self.adapters is not None and not self.adapters.fits({s.adapter for s in items if s.adapter is not None}):
            return False
        longest = max((s.num_tokens for s in items), default=0)
        if not items or longest > self.widths[-1]:
            return False
        width = next(w for w in self.widths if w >= longest)
        return len(items) <= self.sizes[-1] and len(items) * width <= self.max_tokens

    def bucket(self, size: int, width: int, context: int) -> _Bucket:
        """Empty static buffers for a graph of ``size`` rows of ``width`` tokens at context bucket ``context``."""
        return _Bucket(size, context, self.block_size, self.device, self.model.kv_layout.num_lanes, width)

    def key(self, items: list[ScheduledSeq]) -> tuple[int, int, int]:
        """(batch size, tokens a row, context bucket) of the graph a step replays."""
        width = next(w for w in self.widths if w >= max(s.num_tokens for s in items))
        longest = max(s.context_len for s in items)
        return (next(s for s in self.sizes if s >= len(items)), width,
                next(c for c in self.contexts if c >= longest))

    def run(self, items: list[ScheduledSeq], tables: KeptTables, holes: Placeholders | None = None
            ) -> tuple[torch.Tensor, list[int]]:
        """Logits of every token slot of a step ``can_run`` takes, and where each item's last token is
        among them (``tables``: the runner's, updated; ``holes``: placeholder tokens to fill from the
        previous step's, on the device)."""
        key = self.key(items)
        bucket = self._buckets.get(key) or self._capture(*key)
        last_index, places = self._load(bucket, items, tables)
        if holes is not None:
            holes.fill(bucket.ids, places)
        bucket.graph.replay()
        return bucket.logits, last_index

    def _load(self, bucket: _Bucket, items: list[ScheduledSeq], kept: KeptTables) -> tuple[list[int], list[int]]:
        """The step into the bucket's buffers, each row's tokens at the start of its ``width`` places
        and padding after (the module's docstring); each item's last token's place among them, and
        each token's place.
        Padding rows attend over their own positions in block 0, never what an earlier, larger step
        left in the tables (a sliding-window row's first entry can be the released-block marker, -1)."""
        width, n, cpu, tokens = bucket.width, len(items), torch.device("cpu"), bucket.size * bucket.width
        rows = _host_rows(items, width, bucket.size)
        for name in ("ids", "positions", "seq_lens", "lens"):
            _copy(getattr(bucket, name), rows[name])
        seq_ids = [s.seq_id for s in items]
        slots = kept.slots(rows["token_seqs"], rows["token_positions"], self.block_size, cpu)
        every_lane = kept.tables(seq_ids, cpu)
        reach = min(bucket.max_blocks, -(-max(rows["lens"][:n]) // self.block_size))  # entries any query reads
        if width > 1:  # entries past a row's own blocks zeroed: its padding may read a block past them (block 0, then)
            own = torch.arange(every_lane.shape[2])[None, :] < torch.tensor([kept.length(i) for i in seq_ids])[:, None]
            every_lane = every_lane.where(own, 0)
        cols = min(every_lane.shape[2], reach)
        real = torch.tensor(rows["places"], dtype=torch.int64) if width > 1 else None
        for lane, (lane_slots, target) in enumerate(zip(bucket.lane_slots, bucket.lane_tables)):
            if real is None:  # a decode: one place a row
                lane_slots[:n].copy_(slots[lane], non_blocking=True)
                lane_slots[n:].fill_(-1)
            else:
                host_slots = torch.full((tokens,), -1, dtype=torch.int64)
                host_slots[real] = slots[lane]
                lane_slots.copy_(host_slots, non_blocking=True)
            target[:n, :cols].copy_(every_lane[lane, :, :cols], non_blocking=True)
            if cols < reach:
                target[:n, cols:reach].zero_()
            target[n:, :reach].zero_()  # padding rows: block 0; entries past reach are never read
        if self.adapters is not None:
            self.adapters.load(items, bucket.adapter_slots, width)
        return [row * width + s.num_tokens - 1 for row, s in enumerate(items)], rows["places"]

    def _metadata(self, bucket: _Bucket) -> AttentionMetadata:
        first = self._lane_metadata(bucket, 0)
        return replace(first, other_lanes=tuple(self._lane_metadata(bucket, lane)
                                                for lane in range(1, len(bucket.lane_slots))))

    def _lane_metadata(self, bucket: _Bucket, lane: int) -> AttentionMetadata:
        dev, tables = self.device, bucket.lane_tables[lane]
        none = dict(block_tables=torch.zeros((0, tables.shape[1]), dtype=torch.int32, device=dev),
                    seq_lens=torch.zeros(0, dtype=torch.int32, device=dev))
        if bucket.width == 1:  # decodes
            return AttentionMetadata(
                slot_mapping=bucket.lane_slots[lane], num_decodes=bucket.size, decode_block_tables=tables,
                decode_seq_lens=bucket.lens, prefill_block_tables=none["block_tables"], prefill_seq_lens=none["seq_lens"],
                prefill_query_start=torch.zeros(1, dtype=torch.int32, device=dev), decode_max_seq_len=bucket.context,
                token_seq_lens=bucket.seq_lens,
            )
        return AttentionMetadata(  # rows of width queries, on the prefill kernel
            slot_mapping=bucket.lane_slots[lane], num_decodes=0, decode_block_tables=none["block_tables"],
            decode_seq_lens=none["seq_lens"], prefill_block_tables=tables, prefill_seq_lens=bucket.lens,
            prefill_query_start=bucket.query_start, prefill_max_query_len=bucket.width,
            prefill_max_seq_len=bucket.context + bucket.width - 1, token_seq_lens=bucket.seq_lens,
        )

    def _forward(self, bucket: _Bucket, meta: AttentionMetadata) -> torch.Tensor:
        with self.adapters.bound(bucket.adapter_slots) if self.adapters is not None else nullcontext():
            hidden = self.model(bucket.ids, bucket.positions, meta, self.kv_caches)
        return self.model.compute_logits(hidden)

    def _capture(self, size: int, width: int, context: int) -> _Bucket:
        bucket = self.bucket(size, width, context)
        meta = self._metadata(bucket)
        compute = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(compute)
        with torch.cuda.stream(side):  # warm-up: compiles the kernels, settles the allocator
            for _ in range(2):
                warm = self._forward(bucket, meta)
        compute.wait_stream(side)
        if self._logits is None:  # every graph's logits land here: one buffer, not one held per graph
            self._logits = torch.empty((self.max_tokens, warm.shape[-1]), dtype=warm.dtype, device=self.device)
        del warm
        bucket.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(bucket.graph, pool=self._pool):
            logits = self._forward(bucket, meta)
            self._logits[: logits.shape[0]].copy_(logits)
            del logits  # freed into the shared pool at the capture's end: a later graph's capture reuses it
        bucket.logits = self._logits[: size * width]
        self._pool = bucket.graph.pool()
        self._buckets[(size, width, context)] = bucket
        return bucket

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every batch size of the smallest context bucket now, largest first (so smaller
        ones reuse its memory); no autograd state is recorded, as in the forward that replays them."""
        for size in reversed(self.sizes):
            if (size, 1, self.contexts[0]) not in self._buckets:
                self._capture(size, 1, self.contexts[0])


def _host_rows(items: list[ScheduledSeq], width: int, size: int) -> dict[str, list[int]]:
    """A step's host lists for a bucket of ``size`` rows of ``width`` places: each place's token id,
    position and rope length, each row's context with its padding (``lens``), and each real token's
    sequence, position and place. A decode (one place a row, every step at batch 256) takes a
    comprehension a list; rows of drafts a loop over the rows."""
    n = len(items)
    if width == 1:
        positions = [s.start for s in items]
        lens = [s.start + 1 for s in items]
        return dict(ids=[s.token_ids[0] for s in items], positions=positions,
                    # as the eager step: a one-token chunk of a longer prompt rotates by the prompt's length
                    seq_lens=[max(s.seq_len, end) for s, end in zip(items, lens)] + [1] * (size - n),
                    lens=lens + [1] * (size - n), token_seqs=[s.seq_id for s in items], token_positions=positions,
                    places=list(range(n)))
    tokens = size * width
    rows = dict(ids=[0] * tokens, positions=[0] * tokens, seq_lens=[1] * tokens, lens=[width] * size, token_seqs=[],
                token_positions=[], places=[])
    for row, s in enumerate(items):
        at, count, end = row * width, len(s.token_ids), s.start + len(s.token_ids)
        rows["ids"][at : at + count] = s.token_ids
        # the padding at the row's last position: a valid rotary position, never past the model's length
        rows["positions"][at : at + width] = [*range(s.start, end), *[end - 1] * (width - count)]
        rows["seq_lens"][at : at + width] = [max(s.seq_len, end)] * width
        rows["lens"][row] = end + width - count
        rows["places"].extend(range(at, at + count))
        rows["token_seqs"].extend([s.seq_id] * count)
        rows["token_positions"].extend(range(s.start, end))
    return rows


def _copy(target: torch.Tensor, values: list) -> None:
    """``values`` into the start of a static buffer, from the host without a sync."""
    target[: len(values)].copy_(torch.tensor(values, dtype=target.dtype, device="cpu"), non_blocking=True)
