"""Exact block ids and reference counts for paging, fork/CoW, prefix hits, eviction and swap."""

import pytest

from pagedserve.worker.core.kv_cache.block_manager import BlockManager
from pagedserve.worker.core.kv_cache.table_reports import BlockUsage
from pagedserve.worker.core.kv_cache.block_pool import BlockPool
from pagedserve.worker.core.kv_cache.errors import OutOfBlocksError


def new_seq(bm: BlockManager, seq_id: int, tokens: list[int], extra_key=None) -> int:
    cached = bm.start(seq_id, bm.match_prefix(tokens, extra_key))
    bm.grow(seq_id, len(tokens) - cached)
    return cached


def prefilled(bm: BlockManager, *prompts: list[int]) -> tuple[list[int], ...]:
    """Sequences 0, 1 … with these prompts computed and their full blocks published."""
    for seq_id, prompt in enumerate(prompts):
        new_seq(bm, seq_id, prompt)
        bm.register_full_blocks(seq_id, prompt, len(prompt))
    return prompts


def test_allocates_a_block_at_a_time():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.start(0)
    assert bm.grow(0, 3) == []
    assert bm.block_table(0) == (0,)
    bm.grow(0, 1)
    assert bm.block_table(0) == (0,)
    bm.grow(0, 1)
    assert bm.block_table(0) == (0, 1)
    assert bm.usage().used == 2 and bm.usage().tokens_held == 5
    assert bm.usage().slot_utilization == pytest.approx(5 / 8)
    bm.check_invariants()
    bm.free(0)
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_block_size_one_and_odd_sizes():
    for block_size in (1, 7):
        bm = BlockManager(num_blocks=40, block_size=block_size)
        bm.start(0)
        bm.grow(0, 20)
        assert len(bm.block_table(0)) == -(-20 // block_size)
        bm.check_invariants()


def test_fork_shares_and_copy_on_write_copies_only_the_written_block():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    bm.start(0)
    bm.grow(0, 6)  # blocks 0 (full) and 1 (2 of 4 slots)
    bm.fork(0, 1)
    bm.fork(0, 2)
    assert bm.block_table(1) == bm.block_table(2) == (0, 1)
    assert bm.gpu.ref_count(0) == 3 and bm.gpu.ref_count(1) == 3
    bm.check_invariants()
    assert bm.cost_to_grow([(0, 1), (1, 1), (2, 1)]) == 2  # the last writer keeps the original
    assert bm.grow(1, 1) == [(1, 2)]
    assert bm.block_table(1) == (0, 2)
    assert bm.gpu.ref_count(1) == 2 and bm.gpu.ref_count(2) == 1
    assert bm.grow(2, 1) == [(1, 3)]
    assert bm.grow(0, 1) == []  # refcount back to 1: written in place
    assert bm.block_table(0) == (0, 1)
    assert bm.gpu.ref_count(0) == 3
    bm.check_invariants()
    for seq in (0, 1, 2):
        bm.free(seq)
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_fork_on_a_block_boundary_needs_no_copy():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    bm.start(0)
    bm.grow(0, 4)
    bm.fork(0, 1)
    assert bm.grow(1, 1) == []
    assert bm.block_table(1) == (0, 1)
    assert bm.block_table(0) == (0,)
    bm.check_invariants()


def test_prefix_hit_shares_full_blocks_and_recomputes_last_token():
    bm = BlockManager(num_blocks=10, block_size=4)
    prompt = list(range(100, 112))  # exactly 3 full blocks
    assert new_seq(bm, 0, prompt) == 0
    bm.register_full_blocks(0, prompt, len(prompt))
    assert bm.block_table(0) == (0, 1, 2)
    # The same prompt: only 2 blocks hit, so its last token is computed again.
    hit = bm.match_prefix(prompt)
    assert hit.blocks == (0, 1) and hit.num_reclaimed == 0
    assert new_seq(bm, 1, prompt) == 8
    assert bm.block_table(1) == (0, 1, 3)
    assert [bm.gpu.ref_count(b) for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    # A longer prompt with the same head hits all three.
    assert new_seq(bm, 2, prompt + [7, 8]) == 12
    assert bm.block_table(2) == (0, 1, 2, 4)
    bm.check_invariants()


def test_prefix_cache_respects_extra_key_and_verifies_tokens():
    bm = BlockManager(num_blocks=10, block_size=4)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    new_seq(bm, 0, prompt, extra_key="tenant-a")
    bm.register_full_blocks(0, prompt, len(prompt), "tenant-a")
    assert bm.match_prefix(prompt, "tenant-b").blocks == ()
    assert bm.match_prefix(prompt, "tenant-a").blocks == (0, 1)
    assert bm.match_prefix([1, 2, 3, 4, 0, 0, 0, 0, 9], "tenant-a").blocks == (0,)


def test_freed_blocks_stay_cached_and_are_evicted_least_recent_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = prefilled(bm, [1, 2, 3], [5, 6, 7])
    assert bm.block_table(0) == (0, 1) and bm.block_table(1) == (2, 3)
    bm.free(0)
    bm.free(1)
    usage = bm.usage()
    assert usage.free == 4 and usage.cached == 2 and usage.used == 0
    # Cached-free blocks come back on a hit without using a plain free block.
    hit = bm.match_prefix(a)
    assert hit.blocks == (0,) and hit.num_reclaimed == 1
    bm.check_invariants()
    # The plain free blocks go first (most recently freed first), then the least recently
    # freed cached block (0, released before 2).
    bm.start(5)
    bm.grow(5, 6)
    assert bm.block_table(5) == (3, 1, 0)
    assert bm.match_prefix(a).blocks == ()  # stale hash dropped on reuse
    assert bm.match_prefix(b).blocks == (2,)
    bm.check_invariants()


def test_forgetting_the_prefix_cache_frees_cached_blocks_and_keeps_used_ones():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = prefilled(bm, [1, 2, 3], [5, 6, 7])
    bm.free(0)  # a's full block is cached now; b's stays in use
    assert bm.gpu.forget_cached() == 1
    usage = bm.usage()
    assert (usage.free, usage.cached, usage.used) == (4, 0, 2)
    assert bm.match_prefix(a).blocks == () and bm.match_prefix(b).blocks == (2,)
    bm.check_invariants()


def test_duplicate_content_is_published_once():
    bm = BlockManager(num_blocks=8, block_size=2)
    prompt = [1, 2, 3]
    for seq_id in (0, 1):  # both computed before either published (same step)
        bm.start(seq_id)
        bm.grow(seq_id, 3)
    bm.register_full_blocks(0, prompt, 3)
    bm.register_full_blocks(1, prompt, 3)
    assert bm.match_prefix(prompt).blocks == (0,)
    bm.free(1)
    assert bm.usage().cached == 0  # seq 1's copy was never published: plain free
    bm.check_invariants()


def test_swap_round_trip_keeps_sharing_and_counts():
    bm = BlockManager(num_blocks=8, block_size=4, num_cpu_blocks=4, enable_prefix_caching=False)
    bm.start(0)
    bm.grow(0, 6)
    bm.fork(0, 1)
    bm.grow(1, 1)  # seq 1: (0, 2); seq 0: (0, 1)
    assert bm.swap_out_cost([0, 1]) == 3
    out = bm.swap_out([0, 1])
    assert out == [(0, 0), (1, 1), (2, 2)]
    assert bm.is_swapped(0) and bm.num_free_blocks == 8
    assert bm.cpu.ref_count(0) == 2
    bm.check_invariants()
    bm.start(9)
    bm.grow(9, 4)  # takes GPU block 2, the most recently freed, so swap-in lands elsewhere
    assert bm.block_table(9) == (2,)
    assert bm.swap_in_cost([0, 1]) == 3
    back = bm.swap_in([0, 1])
    assert back == [(0, 0), (1, 1), (2, 3)]
    assert bm.block_table(0) == (0, 1) and bm.block_table(1) == (0, 3)
    assert bm.gpu.ref_count(0) == 2 and bm.cpu.num_free == 4
    bm.check_invariants()


def test_swap_out_of_a_block_shared_with_another_request_copies_it():
    bm = BlockManager(num_blocks=8, block_size=2, num_cpu_blocks=4)
    prompt = [1, 2, 3]
    new_seq(bm, 0, prompt)
    bm.register_full_blocks(0, prompt, 3)
    new_seq(bm, 1, prompt)
    assert bm.block_table(1)[0] == 0
    assert bm.swap_out([1]) == [(0, 0), (2, 1)]
    assert bm.gpu.ref_count(0) == 1  # still held by seq 0
    bm.check_invariants()


def test_swap_refuses_when_the_target_pool_is_full():
    bm = BlockManager(num_blocks=4, block_size=2, num_cpu_blocks=1)
    bm.start(0)
    bm.grow(0, 4)
    with pytest.raises(ValueError, match="not enough free cpu blocks"):
        bm.swap_out([0])
    bm.check_invariants()


def test_pool_errors_are_explicit():
    pool = BlockPool(1)
    pool.allocate()
    with pytest.raises(OutOfBlocksError):
        pool.allocate()
    pool.decref(0)
    with pytest.raises(ValueError):
        pool.decref(0)
    with pytest.raises(ValueError):
        BlockManager(num_blocks=4, block_size=0)


def test_invariant_check_catches_corruption():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.start(0)
    bm.grow(0, 3)
    bm._tables[0][0].append(3)  # a table entry the pool never handed out
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_usage_reports_every_figure_exactly():
    bm = BlockManager(num_blocks=8, block_size=4, num_cpu_blocks=6, enable_prefix_caching=False)
    assert bm.usage() == BlockUsage(total=8, used=0, free=8, cached=0, cpu_total=6, cpu_used=0, logical=0,
                                    tokens_held=0, slot_utilization=1.0)
    bm.start(0)
    bm.grow(0, 6)  # blocks 0 (full) and 1 (2 of 4)
    bm.fork(0, 1)  # shares both: 4 table entries on 2 blocks
    bm.start(2)
    bm.grow(2, 3)  # block 2 (3 of 4)
    assert bm.usage() == BlockUsage(total=8, used=3, free=5, cached=0, cpu_total=6, cpu_used=0, logical=5,
                                    tokens_held=4 + 2 + 3, slot_utilization=9 / 12)
    bm.swap_out([2])
    usage = bm.usage()
    assert (usage.used, usage.cpu_used, usage.logical, usage.tokens_held) == (2, 1, 4, 6)


def corrupted_pools():
    """A small pool in a consistent state (a used block, a cached one, plain free ones), and ways
    to break each of its invariants."""

    def fresh() -> BlockPool:
        pool = BlockPool(4)
        used, cached = pool.allocate(), pool.allocate()
        pool.register(cached, 111, ("k",))
        pool.decref(cached)  # refcount 0 with a hash: cached
        return pool, used, cached

    def ref(pool, used, cached):
        pool._ref[used] += 1
    def duplicate_free(pool, used, cached):
        pool._free.append(pool._free[0])
    def free_and_cached(pool, used, cached):
        pool._free.append(cached)
    def free_with_ref(pool, used, cached):
        pool._free.append(used)
    def free_with_hash(pool, used, cached):
        pool._hash_of[pool._free[0]] = 5
        pool._key_of[pool._free[0]] = ("x",)
        pool._block_of_hash[5] = pool._free[0]
    def cached_without_hash(pool, used, cached):
        pool._cached[used] = None
        pool._ref[used] = 0
    def stale_hash(pool, used, cached):
        pool._block_of_hash[222] = cached
    def sizes_differ(pool, used, cached):
        pool._key_of[used] = ("y",)

    return fresh, [ref, duplicate_free, free_and_cached, free_with_ref, free_with_hash, cached_without_hash,
                   stale_hash, sizes_differ]


@pytest.mark.parametrize("corrupt", corrupted_pools()[1], ids=lambda f: f.__name__)
def test_the_pool_check_catches_each_kind_of_corruption(corrupt):
    fresh, _ = corrupted_pools()
    pool, used, cached = fresh()
    pool.check_invariants({used: 1})  # consistent before
    corrupt(pool, used, cached)
    refs = {used: 1} if corrupt.__name__ != "cached_without_hash" else {}
    with pytest.raises(AssertionError, match="gpu pool invariants broken"):
        pool.check_invariants(refs)


def test_defaults_and_pool_names():
    bm = BlockManager(8)
    assert (bm.block_size, bm.cpu.num_blocks, bm.gpu.name, bm.cpu.name) == (16, 0, "gpu", "cpu")


def test_release_before_returns_blocks_outside_a_sliding_window():
    """Released entries become NO_BLOCK, their blocks go back (published ones to the prefix cache,
    evictable); forks, swaps and frees skip them; the invariants hold throughout."""
    from pagedserve.worker.core.kv_cache.block_manager import NO_BLOCK

    bm = BlockManager(num_blocks=12, block_size=4, num_cpu_blocks=12, lane_windows=(8,))
    bm.start(0)
    bm.grow(0, 18)  # 5 blocks
    tokens = list(range(18))
    bm.register_full_blocks(0, tokens, 18)
    assert bm.release_before(0, 9) == 2 and bm.block_table(0)[:2] == (NO_BLOCK, NO_BLOCK)
    assert bm.num_free_blocks == 12 - 3 and bm.gpu.num_cached >= 2  # published blocks stay findable
    assert bm.release_before(0, 9) == 0  # nothing more before position 9
    bm.check_invariants()
    bm.fork(0, 1)
    assert bm.block_table(1)[:2] == (NO_BLOCK, NO_BLOCK)
    bm.check_invariants()
    bm.swap_out([0, 1])
    assert bm.cpu.num_used == 3
    bm.swap_in([0, 1])
    assert bm.block_table(0)[:2] == (NO_BLOCK, NO_BLOCK) and bm.block_table(0) == bm.block_table(1)
    bm.check_invariants()
    bm.free(0)
    bm.free(1)
    bm.check_invariants()
    assert bm.gpu.num_used == 0
