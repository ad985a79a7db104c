"""Lanes of layers (worker/core/kv_cache/kv_layout.py) in the block manager: the layout of real
hybrid models, one table per lane from one pool, a sliding lane's release, the prefix rule per
lane, and a seeded random workload (forks, swaps, recompute, prefix hits, windows) with the
invariants checked after every operation."""

import random

import pytest

from pagedserve.worker.core.kv_cache.block_manager import BlockManager
from pagedserve.worker.core.kv_cache.block_tables import NO_BLOCK
from pagedserve.worker.core.kv_cache.kv_layout import KvLayout


def test_layouts_of_real_hybrid_models_need_no_padding():
    gemma3_270m = KvLayout.of(([512] * 5 + [0]) * 3)  # 15 sliding, 3 full
    assert (gemma3_270m.slots, gemma3_270m.lane_windows) == (3, (0,) + (512,) * 5)
    assert gemma3_270m.layer_lanes[:6] == (1, 1, 1, 2, 2, 0) and gemma3_270m.layer_slots[:6] == (0, 1, 2, 0, 1, 0)
    gemma3_27b = KvLayout.of(([1024] * 5 + [0]) * 10 + [1024] * 2)  # 52 sliding, 10 full: vLLM pads to 8 groups of 10
    assert (gemma3_27b.slots, gemma3_27b.lane_windows.count(0), gemma3_27b.num_lanes) == (2, 5, 31)
    llama = KvLayout.of([0] * 16)
    assert (llama.slots, llama.lane_windows, llama.hybrid) == (16, (0,), False)
    assert KvLayout.single([512, 0, 512]) == KvLayout.uniform(3) and KvLayout.single([8, 8]).lane_windows == (8,)
    for layout in (gemma3_270m, gemma3_27b):  # each (lane, row) holds exactly one layer
        assert len(set(zip(layout.layer_lanes, layout.layer_slots))) == layout.num_layers
    with pytest.raises(ValueError):
        KvLayout.of([])
    assert gemma3_270m.blocks_held(8192, 16) == 512 + 5 * 33


def test_each_lane_has_its_table_and_a_sliding_lane_releases_its_old_blocks():
    bm = BlockManager(num_blocks=64, block_size=4, num_cpu_blocks=64, lane_windows=(0, 8))
    bm.start(0)
    assert bm.cost_to_grow([(0, 10)]) == 6
    bm.grow(0, 10)
    assert bm.block_table(0) == (0, 1, 2) and bm.lane_tables(0) == ((3, 4, 5),)
    assert bm.release_outside_windows(0, 10) == 0  # position 10 sees 3..9: block 0 still
    bm.grow(0, 6)
    assert bm.release_outside_windows(0, 16) == 2  # 16 sees 9..15: blocks 2 and 3
    assert bm.lane_tables(0)[0][:2] == (NO_BLOCK, NO_BLOCK) and NO_BLOCK not in bm.block_table(0)
    bm.check_invariants()
    bm.fork(0, 1)
    assert bm.cost_to_grow([(1, 1)]) == 2  # slot 16 starts a new block in each lane: 2 new, no copy
    bm.swap_out([0, 1])
    bm.check_invariants()
    bm.swap_in([0, 1])
    assert bm.lane_tables(1)[0][:2] == (NO_BLOCK, NO_BLOCK)
    bm.free(0)
    bm.free(1)
    bm.check_invariants()
    assert bm.num_free_blocks == 64


def _published(bm, seq_id, tokens):
    bm.register_full_blocks(seq_id, tokens, len(tokens))
    bm.release_outside_windows(seq_id, len(tokens))


def test_a_hit_takes_the_whole_prefix_of_a_full_lane_and_the_window_of_a_sliding_one():
    bm = BlockManager(num_blocks=64, block_size=4, lane_windows=(0, 8))
    prompt = list(range(100, 141))  # 41 tokens: a hit covers at most 10 blocks
    bm.start(0)
    bm.grow(0, 41)
    _published(bm, 0, prompt)
    bm.free(0)
    hit = bm.match_prefix(prompt)
    assert len(hit.blocks) == 10 and NO_BLOCK not in hit.blocks
    _, sliding = hit.tables
    assert sliding[:8] == (NO_BLOCK,) * 8 and NO_BLOCK not in sliding[8:]  # position 40 sees 33..39: blocks 8, 9
    bm.start(1, hit)
    bm.check_invariants()
    assert bm.num_slots(1) == 40


def test_a_sliding_lane_missing_its_window_shortens_the_hit_to_where_it_has_one():
    bm = BlockManager(num_blocks=64, block_size=4, lane_windows=(0, 4))
    prompt = list(range(200, 233))  # 8 full blocks can hit
    bm.start(0)
    bm.grow(0, 33)
    bm.register_full_blocks(0, prompt, 33)
    lanes = bm._tables[0]
    lost = lanes[1][7]  # the sliding lane's copy of block 7: gone from the prefix cache
    bm.free(0)
    while bm.gpu.is_cached_free(lost):  # take every free block, then the least recently released: it
        bm.gpu.allocate()
    hit = bm.match_prefix(prompt)
    assert len(hit.blocks) == 7 and hit.tables[1][6] != NO_BLOCK  # position 28 sees 25..27: block 6


def test_a_hit_from_the_host_tier_copies_up_only_what_each_lane_reads():
    """Every block of a 41-token prompt pushed from the device to the host tier: the hit names the
    full lane's ten blocks and the sliding lane's last two below the device, and promotes those 12
    (not 20); the started sequence's tables hold device blocks where the hit's did."""
    from pagedserve.worker.core.kv_cache.block_tables import BELOW
    from pagedserve.worker.core.kv_cache.host_tier import HostTier
    from pagedserve.worker.core.kv_cache.tiers import KvTiers

    tiers = KvTiers(HostTier(32), None)
    bm = BlockManager(num_blocks=24, block_size=4, lane_windows=(0, 8), tiers=tiers)
    prompt = list(range(100, 141))
    bm.start(0)
    bm.grow(0, 41)
    _published(bm, 0, prompt)
    bm.free(0)
    bm.start(1)
    bm.grow(1, 12 * 4)  # every block of the pool (12 a lane): each cached one is evicted, demoted to the host
    bm.free(1)
    hit = bm.match_prefix(prompt)
    full, sliding = hit.tables
    assert full == (BELOW,) * 10 and sliding == (NO_BLOCK,) * 8 + (BELOW,) * 2 and len(hit.lower) == 12
    assert bm.start_cost(hit, 41) == 11 + 11 - 8 and hit.num_lower_blocks == 10
    bm.hold([hit])
    assert bm.start(2, hit) == 40 and bm.promote(2, hit) == 40
    assert BELOW not in bm.block_table(2) + bm.lane_tables(2)[0] and tiers.stats.host_hits == 12
    assert tiers.take_moves().promotions and not bm.match_prefix(prompt).lower  # now on the device
    bm.check_invariants()


def test_seeded_random_workload_keeps_every_invariant():
    """Starts (prefix hits), steps, forks, rewinds, swaps and frees at random; after each, the
    invariants, the sliding lanes' bound, and a runner's view: it takes a sequence's table changes
    only now and then (when the sequence is scheduled) and must then hold every live entry."""
    rng = random.Random(61)
    runner: dict[int, list[list[int]]] = {}  # seq -> its tables as a runner keeps them
    windows, bs = (0, 6, 6, 0, 10), 4
    bm = BlockManager(num_blocks=300, block_size=bs, num_cpu_blocks=300, lane_windows=windows)
    tokens: dict[int, list[int]] = {}
    computed: dict[int, int] = {}
    system = [rng.randint(0, 50) for _ in range(23)]
    next_id = 0
    for _ in range(3000):
        op = rng.random()
        live = [s for s in tokens if bm.has_seq(s) and not bm.is_swapped(s)]
        if op < 0.2 or not live:
            prompt = system[: rng.randint(0, 23)] + [rng.randint(0, 50) for _ in range(rng.randint(1, 20))]
            hit = bm.match_prefix(prompt)
            if bm.start_cost(hit, len(prompt)) + hit.num_reclaimed > bm.num_free_blocks:
                continue
            computed[next_id] = bm.start(next_id, hit)
            bm.grow(next_id, len(prompt) - computed[next_id])
            tokens[next_id] = prompt
            next_id += 1
        elif op < 0.65:  # a step: compute what was granted, publish, release, grow by one
            seq = rng.choice(live)
            computed[seq] = bm.num_slots(seq)
            _published(bm, seq, tokens[seq])
            tokens[seq].append(rng.randint(0, 50))
            if bm.cost_to_grow([(seq, 1)]) <= bm.num_free_blocks:
                bm.grow(seq, 1)
        elif op < 0.75 and bm.cost_to_grow([(s, 0) for s in live]) == 0:
            parent = rng.choice(live)
            if bm.num_slots(parent) == computed[parent]:
                bm.fork(parent, next_id)
                tokens[next_id], computed[next_id] = list(tokens[parent]), computed[parent]
                next_id += 1
        elif op < 0.8:  # a draft's slots given back
            seq = rng.choice(live)
            keep = max(computed[seq], bm.num_slots(seq) - rng.randint(0, 6))
            bm.rewind(seq, keep)
            del tokens[seq][keep:]
        elif op < 0.87:
            seq = rng.choice(live)
            if bm.swap_out_cost([seq]) <= bm.cpu.num_free:
                bm.swap_out([seq])
        elif op < 0.92:
            swapped = [s for s in tokens if bm.is_swapped(s)]
            if swapped and bm.swap_in_cost(swapped[:1]) <= bm.num_free_blocks:
                bm.swap_in(swapped[:1])
        else:
            seq = rng.choice(list(tokens))
            bm.free(seq)
            del tokens[seq], computed[seq]
        bm.check_invariants()
        for seq in tokens:
            if bm.has_seq(seq) and not bm.is_swapped(seq):
                lanes = (bm.block_table(seq),) + bm.lane_tables(seq)
                if rng.random() < 0.5:  # scheduled: the runner takes what changed since it last was
                    start, tails = bm.table_change(seq)
                    kept = runner.get(seq, [[] for _ in windows])
                    assert all(len(table) >= start for table in kept), (seq, start, kept)
                    runner[seq] = [table[:start] + list(tail) for table, tail in zip(kept, tails)]
                    for table, seen in zip(lanes, runner[seq]):
                        assert len(seen) == len(table)
                        assert all(b == NO_BLOCK or b == s for b, s in zip(table, seen)), (seq, table, seen)
                for window, table in zip(windows, lanes):
                    held = [b for b in table if b != NO_BLOCK]
                    if window and bm.num_slots(seq) == computed[seq]:
                        assert len(held) <= -(-window // bs) + 1, (window, table)
    assert next_id > 100 and bm.usage().used > 0


def test_the_kv_budget_counts_every_lane():
    """Gemma 3 270M's lanes, 2 GiB of float32 KV in blocks of 16 (3 layers: 96 KiB each): one sequence
    may be as long as the full lane's share leaves room for the sliding lanes' windows and a chunk;
    an asked context past it is refused with the pool's own bytes."""
    from pagedserve.worker.setup.kv_budget import ContextDoesNotFit, KvBudget

    lanes = (0,) + (512,) * 5
    budget = KvBudget(blocks=21845, block_size=16, bytes_per_token=6144, lane_windows=lanes, chunk=2048)
    assert budget.blocks_for(8192) == 512 + 5 * (-(-(512 + 2048) // 16) + 1)
    assert budget.tokens == budget.longest() == (21845 - 5 * 161) * 16
    assert budget.fit_context(32768, asked=True) == 32768 and budget.full_sequences(8192) == 21845 // 1317
    with pytest.raises(ContextDoesNotFit, match=r"holds 21845 blocks \(336640 tokens, 2.00 GiB\)"):
        budget.fit_context(400_000, asked=True)
    assert budget.fit_context(400_000, asked=False) == 336640
    one_table = KvBudget(blocks=3640, block_size=16, bytes_per_token=36864)  # the same bytes, one lane of 18 layers
    assert one_table.tokens == 3640 * 16 and one_table.full_sequences(8192) == 7


def test_a_lanes_hash_and_key_keep_it_apart_from_the_prefixs_own():
    from pagedserve.worker.core.kv_cache.lane_hits import LANE_BIT, first_seen, is_lane_hash, lane_hash, lane_key

    base = 0x5A5A_1234_9876_0F0F  # a prefix hash: 63 bits
    assert lane_hash(base, 0) == base and not is_lane_hash(base) and not is_lane_hash(LANE_BIT - 1)
    ones = LANE_BIT - 1  # every low bit set: the mix is an exclusive or, not an and
    assert lane_hash(ones, 1) == LANE_BIT | (ones ^ (0x9E3779B97F4A7C15 & ones))
    assert lane_hash(0, 1) & 1 == 1  # the mix's lowest bit survives the mask
    assert is_lane_hash(LANE_BIT) and is_lane_hash(lane_hash(base, 2)) and lane_hash(base, 1) != lane_hash(base, 2)
    key = ("parent", (1, 2, 3), "salt")
    assert lane_key(key, 0) is key
    assert lane_key(key, 1) == ("parent", (1, 2, 3), ("lane", 1, "salt")) != lane_key(key, 2)
    # a query at position 8 blocks * 4 reads from 32 - window + 1: the first block holding it
    assert first_seen(8, 0, 4) == 0 and first_seen(8, 8, 4) == 6 and first_seen(8, 9, 4) == 6 and first_seen(8, 6, 4) == 6
    assert first_seen(8, 5, 4) == 7 and first_seen(1, 4, 4) == 0 and first_seen(2, 40, 4) == 0 == first_seen(2, 40, 1)
