"""What starting a waiting request takes from the block pool, and the start itself: each sequence's
prefix hit (device and tiers below), its first chunk under the step's token budget, the free blocks
those take now, and the blocks its whole prompt will hold (every lane: a sliding one its window and
a chunk). The scheduler admits a request beside running ones only when its whole prompt fits what
their prompts still need (``Scheduler._schedule_waiting``): a long prompt admitted on its first
chunk alone is preempted by the others' growth before it ends, over and over, where memory binds.

No I/O and no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from pagedserve.worker.core.kv_cache.block_manager import BlockManager
from pagedserve.worker.core.kv_cache.prefix_hit import PrefixHit
from pagedserve.worker.core.kv_cache.kv_layout import blocks_held
from pagedserve.worker.core.scheduling.config import SchedulerConfig
from pagedserve.worker.core.scheduling.request import Request, Sequence


@dataclass(frozen=True)
class Admission:
    hits: dict[int, PrefixHit]  # seq id -> its prefix hit
    sizes: list[tuple[int, int]]  # (seq id, tokens of its first chunk)
    now: int  # free blocks the first chunks take (the cached-free blocks the hits reclaim included)
    whole: int  # free blocks the whole prompts take


def prompt_need(config: SchedulerConfig, seq: Sequence) -> int:
    """Blocks a sequence holds once its whole prompt is in, its output to come not counted."""
    return blocks_held(config.lane_windows, seq.prompt_len, config.block_size, config.max_num_batched_tokens)


def prompts_to_finish(blocks: BlockManager, config: SchedulerConfig, running: Iterable[Request]) -> int:
    """Blocks the running sequences still take before their prompts are in."""
    return sum(max(0, prompt_need(config, s) - blocks.num_held(s.seq_id))
               for r in running for s in r.live_seqs if s.num_computed < s.prompt_len)


def admission(blocks: BlockManager, config: SchedulerConfig, req: Request, hits: dict[int, PrefixHit],
              budget: int, timed: Callable[[int, int], int] = lambda start, count: count) -> Admission:
    """What starting ``req`` from ``hits`` with ``budget`` tokens left in the step takes; ``timed``
    cuts a first chunk of ``count`` tokens from ``start`` to the step's time (``Scheduler._timed``)."""
    reclaimed = {b for hit in hits.values() for b in hit.held() if blocks.gpu.is_cached_free(b)}
    sizes, new_blocks = [], 0
    for seq in req.live_seqs:
        hit = hits[seq.seq_id]
        cached = hit.num_blocks * config.block_size
        count = timed(cached, min(seq.num_tokens - cached, budget))
        budget -= count
        sizes.append((seq.seq_id, count))
        new_blocks += blocks.start_cost(hit, cached + count)  # promoted blocks are new
    whole = sum(max(0, prompt_need(config, seq) - len(hits[seq.seq_id].held())) for seq in req.live_seqs)
    return Admission(hits, sizes, len(reclaimed) + new_blocks, whole + len(reclaimed))


def start_request(blocks: BlockManager, req: Request, taken: Admission) -> tuple[int, int, int]:
    """Give ``req``'s sequences their blocks: every device hit first (a promotion's allocation may
    evict a cached one), then the blocks copied up from below. Sets each sequence's computed
    tokens and, at its first start, what the request is told the cache served. Returns ``(tokens
    asked, tokens hit, tokens from the tiers)`` for the prefix-cache counters."""
    blocks.hold(list(taken.hits.values()))
    for seq in req.live_seqs:
        blocks.start(seq.seq_id, taken.hits[seq.seq_id])
    asked = hit = below = 0
    for seq in req.live_seqs:
        seq.num_computed = blocks.promote(seq.seq_id, taken.hits[seq.seq_id])
        asked, hit = asked + seq.num_tokens, hit + seq.num_computed
        below += taken.hits[seq.seq_id].num_lower_blocks * blocks.block_size
    if req.cached_tokens is None:  # what a client is told the cache served: its first start's hit
        first = req.live_seqs[0]
        req.cached_tokens = min(first.num_computed, len(req.prompt_ids))
        req.tier_cached_tokens = min(taken.hits[first.seq_id].num_lower_blocks * blocks.block_size, req.cached_tokens)
    return asked, hit, below
