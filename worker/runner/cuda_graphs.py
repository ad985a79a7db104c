"""CUDA graphs for decode steps: one graph per batch-size bucket, captured on first use.

A decode step of a small model is mostly kernel-launch overhead; replaying a captured graph
launches everything at once. Each bucket has static input buffers (token ids, positions, slots,
block tables, context lengths) and a static logits output; a step of ``n`` sequences copies its
inputs into the smallest bucket ``>= n`` and replays it. Padding rows write no K/V (slot -1, which
the store kernel skips) and attend over one token of block 0; their logits are dropped.

The graphs need the Triton kernels (the torch reference reads lengths back to the host) and a
fixed launch grid, so the decode kernel is launched for ``max_model_len`` (programs past a
sequence's length return at once). All buckets share one memory pool, captured largest first.
Prefill and mixed steps run eagerly. ``enforce_eager`` turns graphs off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.worker.core.plan import ScheduledSeq
from pagedserve.worker.runner.attention import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


@dataclass(frozen=True)
class GraphLimits:
    max_model_len: int
    max_num_seqs: int


class _Bucket:
    """The static buffers of one captured batch size."""

    def __init__(self, size: int, max_blocks: int, device: torch.device) -> None:
        self.size = size
        self.ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slots = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.tables = torch.zeros((size, max_blocks), dtype=torch.int32, device=device)
        self.lens = torch.ones(size, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)  # rope's length: tokens known, computed or not
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None


class DecodeGraphs:
    def __init__(self, model, kv_caches, device: torch.device, block_size: int, limits: GraphLimits) -> None:
        self.model, self.kv_caches, self.device, self.block_size = model, kv_caches, device, block_size
        self.max_model_len = limits.max_model_len
        self.max_blocks = -(-limits.max_model_len // block_size)
        self.sizes = sorted({b for b in BUCKETS if b < limits.max_num_seqs} | {limits.max_num_seqs})
        self._buckets: dict[int, _Bucket] = {}
        self._pool = None

    def can_run(self, items: list[ScheduledSeq]) -> bool:
        return 0 < len(items) <= self.sizes[-1] and all(s.num_tokens == 1 for s in items)

    def run(self, items: list[ScheduledSeq]) -> torch.Tensor:
        """Logits ``[len(items), vocab]`` of a decode-only step."""
        n = len(items)
        bucket = self._buckets.get(size := next(s for s in self.sizes if s >= n)) or self._capture(size)
        self._load(bucket, items)
        bucket.graph.replay()
        return bucket.logits[:n]

    def _load(self, bucket: _Bucket, items: list[ScheduledSeq]) -> None:
        n, width = len(items), max(len(s.block_table) for s in items)
        host = dict(
            ids=[s.token_ids[0] for s in items], positions=[s.start for s in items],
            slots=[s.slot_mapping(self.block_size)[0] for s in items] + [-1] * (bucket.size - n),
            lens=[s.context_len for s in items] + [1] * (bucket.size - n),
            # as the eager step: a one-token chunk of a longer prompt rotates by the prompt's length
            seq_lens=[max(s.seq_len, s.context_len) for s in items] + [1] * (bucket.size - n),
        )
        for name, values in host.items():
            target = getattr(bucket, name)
            target[: len(values)].copy_(torch.tensor(values, dtype=target.dtype, device="cpu"), non_blocking=True)
        # Table entries past a row's length are never read: only the live part is copied. Padding
        # rows read position 0 of their row: block 0, not what an earlier, larger step left there
        # (a sliding-window row's first entry can be the released-block marker, -1).
        tables = [list(s.block_table) + [0] * (width - len(s.block_table)) for s in items]
        tables += [[0] * width] * (bucket.size - n)
        bucket.tables[:, :width].copy_(torch.tensor(tables, dtype=torch.int32, device="cpu"), non_blocking=True)

    def _metadata(self, bucket: _Bucket) -> AttentionMetadata:
        dev = self.device
        return AttentionMetadata(
            slot_mapping=bucket.slots, num_decodes=bucket.size, decode_block_tables=bucket.tables,
            decode_seq_lens=bucket.lens,
            prefill_block_tables=torch.zeros((0, self.max_blocks), dtype=torch.int32, device=dev),
            prefill_seq_lens=torch.zeros(0, dtype=torch.int32, device=dev),
            prefill_query_start=torch.zeros(1, dtype=torch.int32, device=dev),
            decode_max_seq_len=self.max_model_len,
            token_seq_lens=bucket.seq_lens,
        )

    def _forward(self, bucket: _Bucket, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(bucket.ids, bucket.positions, meta, self.kv_caches)
        return self.model.compute_logits(hidden)

    def _capture(self, size: int) -> _Bucket:
        bucket = _Bucket(size, self.max_blocks, self.device)
        meta = self._metadata(bucket)
        compute = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(compute)
        with torch.cuda.stream(side):  # warm-up: compiles the kernels, settles the allocator
            for _ in range(2):
                self._forward(bucket, meta)
        compute.wait_stream(side)
        bucket.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(bucket.graph, pool=self._pool):
            bucket.logits = self._forward(bucket, meta)
        self._pool = bucket.graph.pool()
        self._buckets[size] = bucket
        return bucket

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket now, largest first (so smaller ones reuse its memory); no autograd
        state is recorded, as in the forward that replays them."""
        for size in reversed(self.sizes):
            if size not in self._buckets:
                self._capture(size)
