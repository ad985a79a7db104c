"""The dashboard's snapshot of a real scheduler: refcounts after a fork and a shared prefix, the
request table with its block tables, the bounds at a million blocks and thousands of requests."""

from __future__ import annotations

import msgpack

from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.core.kv_cache.pool_map import decode
from pagedserve.worker.core.scheduling.kv_snapshot import MAX_REQUESTS, MAX_TABLE_ENTRIES, SNAPSHOT_BUDGET, kv_snapshot
from tests.core.test_scheduler import make, step


def assert_values_count_the_tables(cells, rows: list[dict], device: str = "gpu") -> None:
    """Every held block's value is 1 + the listed tables (of ``device``) that name it."""
    refs: dict[int, int] = {}
    for row in rows:
        lanes = [t for seq in row.get("lane_tables", []) for t in seq]
        for table in row["tables"] + lanes if row["device"] == device else ():
            for block in table:
                if block >= 0:
                    refs[block] = refs.get(block, 0) + 1
    assert {b: v for b, v in enumerate(cells) if v >= 2} == {b: 1 + r for b, r in refs.items()}


def params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=6, ignore_eos=True, **kw)


def test_forked_and_prefix_shared_blocks_show_their_refcounts_and_holders():
    sched, sim = make(num_blocks=64, block_size=4)
    system = list(range(100, 112))  # three full blocks, shared through the prefix cache
    sched.add("first", system + [1, 2], params())
    step(sched, sim)
    sched.add("second", system + [3], params())
    sched.add("fork", [7, 8, 9, 10, 11], params(n=3))
    step(sched, sim)
    step(sched, sim)
    snap = kv_snapshot(sched)
    rows = {row["id"]: row for row in snap["requests"]}
    cells, group = decode(snap["gpu"])
    assert group == 1 and len(cells) == 64
    first, second, fork = rows["first"]["tables"][0], rows["second"]["tables"][0], rows["fork"]["tables"]
    assert first[:3] == second[:3]
    assert [cells[b] for b in first[:3]] == [3, 3, 3]  # 1 + two tables
    assert len(fork) == 3 and fork[0][0] == fork[1][0] == fork[2][0]
    assert cells[fork[0][0]] == 4  # the prompt's full block, held by the three samples
    assert_values_count_the_tables(cells, snap["requests"])  # the listing is complete here
    assert rows["fork"]["state"] == "running" and rows["fork"]["device"] == "gpu"
    assert rows["fork"]["blocks"] == len({b for t in fork for b in t})
    assert rows["second"]["prompt"] == 13 and rows["fork"]["generated"] >= 3
    figures = snap["figures"]
    assert figures["logical"] > figures["used"] and figures["prefix_hit_tokens"] == 12
    assert figures["running"] == 3 and snap["unlisted"] == 0
    # Without paging each sequence holds a slot of prompt + max_tokens from the start: 14 + 6 and
    # 13 + 6 tokens (5 blocks each), and three of 5 + 6 (3 blocks each) for the samples.
    assert figures["unpaged"] == 5 + 5 + 3 * 3 > figures["logical"]


def test_a_hybrid_models_lanes_show_their_tables_and_what_one_table_would_hold():
    """A full lane and a sliding one (window 8, blocks of 4): each sequence's sliding table shows its
    released entries; ``one_table`` names every position in both lanes, the lanes' tables less."""
    sched, sim = make(num_blocks=64, block_size=4, lane_windows=(0, 8))
    sched.add("long", list(range(30)), SamplingParams(max_tokens=12, ignore_eos=True))
    sched.add("fork", list(range(50, 61)), SamplingParams(max_tokens=12, ignore_eos=True, n=2))
    for _ in range(5):
        step(sched, sim)
    snap = kv_snapshot(sched)
    rows = {row["id"]: row for row in snap["requests"]}
    assert snap["lanes"] == [0, 8]
    (full,), ((sliding,),) = rows["long"]["tables"], rows["long"]["lane_tables"]
    assert len(full) == len(sliding) == 9 and -1 not in full  # 34 slots
    assert sliding[:6] == [-1] * 6 and -1 not in sliding[6:]  # position 33 sees 26..33: blocks 6..8
    assert len(rows["fork"]["lane_tables"]) == 2 and rows["fork"]["lane_tables"][0][0][0] == rows["fork"]["lane_tables"][1][0][0]
    cells, _ = decode(snap["gpu"])
    assert_values_count_the_tables(cells, snap["requests"])  # the sliding lanes' blocks counted too
    figures = snap["figures"]
    held = sum(len(t) - t.count(-1) for row in snap["requests"] for t in row["tables"] + [t for s in row["lane_tables"] for t in s])
    assert figures["logical"] == held < figures["one_table"] == 2 * (9 + 2 * 4)  # the forks: 16 slots each
    assert figures["unpaged"] == 2 * (-(-42 // 4) + 2 * -(-23 // 4)) > figures["one_table"]


def test_swapped_requests_show_on_the_cpu_pool():
    sched, sim = make(num_blocks=6, block_size=4, num_cpu_blocks=16, preemption_mode="swap")
    for i in range(3):
        sched.add(f"r{i}", [i + 1] * 7, SamplingParams(max_tokens=12, ignore_eos=True))
    snaps = []
    for _ in range(12):
        step(sched, sim)
        snaps.append(kv_snapshot(sched))
    swapped = [(s, row) for s in snaps for row in s["requests"] if row["state"] == "swapped"]
    assert swapped, "the pool is too small for three requests: one must be swapped out"
    snap, row = swapped[0]
    cpu_cells, _ = decode(snap["cpu"])
    assert row["device"] == "cpu" and all(cpu_cells[b] >= 2 for t in row["tables"] for b in t)


def test_a_million_blocks_and_thousands_of_requests_stay_within_the_budget():
    sched, sim = make(num_blocks=1 << 20, block_size=16, num_cpu_blocks=1 << 20, max_num_seqs=4096,
                      max_num_batched_tokens=1 << 20, max_model_len=4096)
    for i in range(2000):
        sched.add(f"cmpl-{i:060d}-too-long-to-list-whole", [i % 50_000 + 1] * 2000, params())
    step(sched, sim)
    snap = kv_snapshot(sched)
    assert len(snap["requests"]) == MAX_REQUESTS and snap["unlisted"] == 2000 - MAX_REQUESTS
    entries = sum(len(t) for row in snap["requests"] for t in row["tables"])
    assert entries == MAX_TABLE_ENTRIES and any(row["cut"] for row in snap["requests"])
    assert all(len(row["id"]) <= 64 for row in snap["requests"])
    # The worst pools (no two cells alike) are bounded in test_pool_map; add them at full size.
    worst_pools = 2 * (3 * 2 * 8192 + 16) - len(msgpack.packb(snap["gpu"])) - len(msgpack.packb(snap["cpu"]))
    assert len(msgpack.packb(snap)) + worst_pools <= SNAPSHOT_BUDGET
