"""What the KV dashboard shows of one worker, taken on the engine thread: both block pools as
pictures (``worker/core/kv_cache/pool_map.py``), the scheduler's counters, and the request table with each sequence's
block table.

Bounded whatever the load: each pool picture within ``pool_map.BYTE_BUDGET``, at most
``MAX_REQUESTS`` requests listed (running first, then swapped, then waiting, each in scheduling
order; ``unlisted`` counts the rest) and ``MAX_TABLE_ENTRIES`` block-table entries over all of
them (a table cut short says so). ``SNAPSHOT_BUDGET`` is the sum of those bounds in msgpack bytes:
two pictures, ``MAX_REQUESTS`` rows of ``ROW_BYTES`` and ``MAX_TABLE_ENTRIES`` entries of at most
5 bytes (block ids below 2^32), plus the figures.

``figures.unpaged`` is what the running requests would reserve without paging (``unpaged_blocks``),
to set against ``used`` (what they hold) and ``logical`` (what their tables name: without sharing).
A hybrid model's lanes (``lanes``: each lane's window, 0 for a full one; worker/core/kv_cache/kv_layout.py)
add ``one_table``: what the running sequences' tables would name with every lane holding every
position, as one table for every layer does (``one_table_blocks``); every figure is in the pool's
blocks (one lane's layers).
With tiers under the prefix cache, ``figures`` also has their occupancy (``tier_figures``); with
speculative decoding, the drafted and kept tokens (``spec_figures``).

A request row: ``id``, ``state`` (running / swapped / waiting), ``prompt`` and ``generated``
tokens (over its sequences), ``age`` in seconds, ``blocks`` (distinct blocks it holds), ``device``
of its blocks, ``tables`` (one per live sequence, its first lane's; ``-1`` marks an entry released by
a sliding window), ``lane_tables`` (each live sequence's further lanes' tables; empty lists with
one lane) and ``cut`` (tables left short to stay in budget).
"""

from __future__ import annotations

from pagedserve.worker.core.kv_cache.pool_map import BYTE_BUDGET, cell_values, encode
from pagedserve.worker.core.scheduling.request import Request

MAX_REQUESTS = 128
MAX_TABLE_ENTRIES = 8192
MAX_ID_CHARS = 64
ROW_BYTES = 176 + MAX_ID_CHARS  # a row's keys, numbers and id, tables aside
SNAPSHOT_BUDGET = 2 * BYTE_BUDGET + MAX_REQUESTS * ROW_BYTES + MAX_TABLE_ENTRIES * 5 + 1024


def kv_snapshot(scheduler) -> dict:
    """The dashboard's view of ``scheduler`` now (call on the thread that steps it)."""
    blocks, stats = scheduler.blocks, scheduler.stats
    usage = blocks.usage()
    queues = (("running", scheduler.running), ("swapped", scheduler.swapped), ("waiting", scheduler.waiting))
    listed = [(state, req) for state, queue in queues for req in queue][:MAX_REQUESTS]
    now, budget, rows = scheduler.clock(), MAX_TABLE_ENTRIES, []
    for state, req in listed:
        row = _row(blocks, req, state, now, budget)
        budget -= sum(len(t) for t in row["tables"]) + sum(len(t) for lanes in row["lane_tables"] for t in lanes)
        rows.append(row)
    lanes = len(blocks.lane_windows)
    return {
        "block_size": blocks.block_size,
        "lanes": list(blocks.lane_windows),
        "gpu": encode(cell_values(blocks.gpu)),
        "cpu": encode(cell_values(blocks.cpu)),
        "figures": {
            "total": usage.total, "used": usage.used, "cached": usage.cached, "logical": usage.logical,
            "cpu_total": usage.cpu_total, "cpu_used": usage.cpu_used, "tokens_held": usage.tokens_held,
            "running": len(scheduler.running), "swapped": len(scheduler.swapped), "waiting": len(scheduler.waiting),
            "preemptions": stats.num_preemptions, "cow_copies": stats.cow_copies,
            "prefix_query_tokens": stats.prefix_query_tokens, "prefix_hit_tokens": stats.prefix_hit_tokens,
            "unpaged": lanes * unpaged_blocks(scheduler.running, blocks.block_size),
            **({"one_table": one_table_blocks(scheduler.running, blocks)} if lanes > 1 else {}),
            **tier_figures(blocks.tiers, stats.tier_hit_tokens),
            **spec_figures(scheduler),
        },
        "requests": rows,
        "unlisted": len(scheduler.running) + len(scheduler.swapped) + len(scheduler.waiting) - len(rows),
    }


def tier_figures(tiers, hit_tokens: int) -> dict:
    """The tiers under the prefix cache, when there are any: host slots held and total, disk
    bytes, and prompt tokens served from them."""
    if tiers is None:
        return {}
    figures = {"tier_hit_tokens": hit_tokens}
    if tiers.host is not None:
        figures.update(host_used=len(tiers.host), host_total=tiers.host.num_slots)
    if tiers.disk is not None:
        figures.update(disk_bytes=tiers.disk.num_bytes, disk_max_bytes=tiers.disk.max_bytes)
    return figures


def spec_figures(scheduler) -> dict:
    """Speculative decoding, when it is on: drafted tokens checked and kept so far."""
    if scheduler.config.speculative is None:
        return {}
    spec = scheduler.applier.spec_stats
    return {"spec_draft_tokens": spec.draft_tokens, "spec_accepted_tokens": spec.accepted_tokens}


def unpaged_blocks(running, block_size: int) -> int:
    """The blocks ``running`` would reserve without paging: each sequence a contiguous slot for
    its request's longest output (prompt + ``max_tokens``), made when it is admitted, never shared."""
    return sum(req.seq_slots * -(-(len(req.prompt_ids) + req.params.max_tokens) // block_size) for req in running)


def one_table_blocks(running, blocks) -> int:
    """The blocks the running sequences' tables would name if every lane held every position (one
    table for every layer, the cache without groups), without sharing."""
    lanes = len(blocks.lane_windows)
    return sum(lanes * blocks.blocks_for(blocks.num_slots(seq.seq_id)) for req in running for seq in req.live_seqs
               if blocks.has_seq(seq.seq_id))


def _row(blocks, req: Request, state: str, now: float, budget: int) -> dict:
    held = [h for h in (blocks.tables_of(seq.seq_id) for seq in req.live_seqs) if h is not None]  # waiting: none
    distinct = {b for _, lanes in held for table in lanes for b in table if b >= 0}
    tables, lane_tables, cut = [], [], False
    for _, lanes in held:
        kept = []
        for table in lanes:
            if len(table) > budget:
                table, cut = table[: max(0, budget)], True
            budget -= len(table)
            kept.append(list(table))
        tables.append(kept[0])
        lane_tables.append(kept[1:])
    return {
        "id": req.request_id[:MAX_ID_CHARS], "state": state, "prompt": len(req.prompt_ids),
        "generated": sum(s.num_output for s in req.seqs), "age": round(max(0.0, now - req.arrival), 3),
        "blocks": len(distinct), "device": held[0][0] if held else None, "tables": tables,
        "lane_tables": lane_tables, "cut": cut,
    }
