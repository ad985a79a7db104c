"""The tiers under the prefix cache (host slots, disk files) through the real scheduler and a
simulated runner whose "KV" is the tokens themselves: a block that comes back wrong from any tier
changes the output. Every step's invariants are checked; the disk tier is a real directory."""

from __future__ import annotations

import random

import pytest

from pagedserve.gateway.routing.kv_index import KvIndex
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.core.kv_cache.disk_tier import DiskTier
from pagedserve.worker.core.kv_cache.host_tier import HostTier
from pagedserve.worker.core.kv_cache.lane_hits import is_lane_hash
from pagedserve.worker.core.kv_cache.tiers import KvTiers
from pagedserve.worker.core.scheduling.config import SchedulerConfig
from pagedserve.worker.core.scheduling.kv_snapshot import kv_snapshot
from tests.core.test_scheduler_simulation import EOS, run_workload
from tests.kv_simulator import reference_output

BLOCK = 4


def conversations(rng: random.Random, count: int, turns: int) -> list[tuple[str, list[int], SamplingParams, int]]:
    """Chats whose histories grow turn by turn, the turns of all chats interleaved: each turn's
    prompt starts with the whole previous one, long after the pool has evicted it."""
    histories = [[rng.randint(1, 96) for _ in range(rng.randint(8, 24))] for _ in range(count)]
    out = []
    for turn in range(turns):
        for chat, history in enumerate(histories):
            history += [rng.randint(1, 96) for _ in range(rng.randint(2, 9))]
            params = SamplingParams(n=rng.choice([1, 1, 2]), max_tokens=rng.randint(1, 6))
            out.append((f"chat{chat}-turn{turn}", list(history), params, 0))
    return out


def config(mode: str, lane_windows: tuple[int, ...] = (0,)) -> SchedulerConfig:
    return SchedulerConfig(num_gpu_blocks=40 * len(lane_windows), block_size=BLOCK, num_cpu_blocks=30 * len(lane_windows),
                           max_num_seqs=8, max_num_batched_tokens=48, max_model_len=256, preemption_mode=mode,
                           lane_windows=lane_windows)


def check_outputs(requests, finished) -> None:
    assert len(finished) == len(requests)
    for rid, prompt, params, _ in requests:
        for o in finished[rid].outputs:
            assert o.token_ids == reference_output(prompt, o.index, params.max_tokens, EOS, params.min_tokens), rid


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("host_slots,disk", [(64, False), (0, True), (8, True)])
def test_chats_whose_prefixes_left_the_pool_get_them_back_exactly(tmp_path, mode, host_slots, disk):
    rng = random.Random(f"{mode}-{host_slots}-{disk}")
    requests = conversations(rng, count=12, turns=5)
    tiers = KvTiers(HostTier(host_slots) if host_slots else None,
                    DiskTier(tmp_path, "sim", 1 << 20, BLOCK * 8) if disk else None)
    routing = KvIndex()  # follows the KV events, checked against the tiers every step
    sched, finished = run_workload(config(mode), requests, rng, tiers, routing)
    check_outputs(requests, finished)
    assert routing.lower["w"] or not tiers.stats.demotions + tiers.stats.spills
    stats = tiers.stats
    assert sched.stats.tier_hit_tokens > 0
    assert stats.host_hits > 0 if host_slots else stats.host_hits == 0
    assert stats.disk_hits > 0 if disk else stats.spills == 0
    if disk:
        assert tiers.disk.stats.corrupt == 0
    figures = kv_snapshot(sched)["figures"]  # what the dashboard shows of the tiers
    assert figures["tier_hit_tokens"] == sched.stats.tier_hit_tokens
    assert (figures.get("host_used"), figures.get("host_total")) == ((len(tiers.host), host_slots) if host_slots else (None, None))
    assert figures.get("disk_bytes") == (tiers.disk.num_bytes if disk else None)


def test_without_tiers_the_same_chats_recompute(tmp_path):
    """The workload above does need the tiers: without them the evicted prefixes are recomputed."""
    rng = random.Random("none")
    requests = conversations(rng, count=12, turns=5)
    sched, finished = run_workload(config("recompute"), requests, rng)
    check_outputs(requests, finished)
    assert sched.stats.tier_hit_tokens == 0 and sched.blocks.tiers is None


def test_a_disk_tier_full_of_other_blocks_and_a_host_of_two_slots_still_give_exact_chats(tmp_path):
    """Every tier under pressure: two host slots (most demotions spill at once), a disk bounded to
    a few blocks (most spills evict another file)."""
    rng = random.Random("pressure")
    requests = conversations(rng, count=12, turns=5)
    bound = 2_000  # bytes: about 15 of these blocks' files
    tiers = KvTiers(HostTier(2), DiskTier(tmp_path, "sim", bound, BLOCK * 8))
    _, finished = run_workload(config("swap"), requests, rng, tiers, KvIndex())
    check_outputs(requests, finished)
    files = sum(f.stat().st_size for f in tiers.disk.root.glob("*.kv"))
    assert tiers.disk.stats.evictions > 0 and files == tiers.disk.num_bytes <= bound
    assert tiers.stats.spills > 0 and tiers.stats.disk_hits > 0


def test_a_second_scheduler_on_the_same_directory_starts_from_the_first_ones_blocks(tmp_path):
    rng = random.Random("restart")
    requests = conversations(rng, count=8, turns=3)
    first = KvTiers(None, DiskTier(tmp_path, "sim", 1 << 20, BLOCK * 8))
    run_workload(config("recompute"), requests, rng, first)
    first.disk.close()
    again = KvTiers(None, DiskTier(tmp_path, "sim", 1 << 20, BLOCK * 8))
    assert len(again.disk) == len(first.disk) > 0
    sched, finished = run_workload(config("recompute"), requests, random.Random("restart"), again)
    check_outputs(requests, finished)
    assert again.stats.disk_hits > 0 and sched.stats.tier_hit_tokens > 0


def test_another_fingerprint_never_reads_the_blocks(tmp_path):
    DiskTier(tmp_path, "model a", 1 << 20, 8).write(5, (None, (1,), None), b"\0" * 8)
    other = DiskTier(tmp_path, "model b", 1 << 20, 8)
    assert len(other) == 0 and not other.request(5)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("host_slots,disk", [(96, False), (0, True), (12, True)])
def test_a_hybrid_models_lanes_come_back_from_the_tiers_exactly(tmp_path, mode, host_slots, disk):
    """A full lane and two sliding lanes of 8 (Gemma 3's shape): every lane's copy of a block is
    demoted, spilled and found on its own; a hit takes the full lane's whole prefix and only the
    sliding lanes' last window from wherever each is; the simulated runner checks each sliding
    lane reads what the full lane holds."""
    rng = random.Random(f"lanes-{mode}-{host_slots}-{disk}")
    requests = conversations(rng, count=12, turns=5)
    tiers = KvTiers(HostTier(host_slots) if host_slots else None,
                    DiskTier(tmp_path, "sim", 1 << 20, BLOCK * 8) if disk else None)
    routing = KvIndex()  # never told of a further lane's hash: only the prefixes, as with one lane
    sched, finished = run_workload(config(mode, (0, 8, 8)), requests, rng, tiers, routing)
    check_outputs(requests, finished)
    assert sched.stats.tier_hit_tokens > 0
    assert tiers.stats.host_hits > 0 if host_slots else tiers.stats.disk_hits > 0
    lane_copies = [h for h in (tiers.host.entries() if host_slots else []) if is_lane_hash(h.block_hash)]
    assert lane_copies or not host_slots, "no sliding lane's block was kept below"


def test_each_demotion_spill_and_drop_is_counted_and_carried_as_its_move(tmp_path):
    """The tiers step by step, without a scheduler: what a demotion becomes with no tier, a host
    tier, a full host tier over a disk tier and a disk tier alone; each step's moves, their sources
    named; the counters exact; an evicted block no tier keeps reported dropped unless on the device."""
    from pagedserve.worker.core.kv_cache.kv_events import KvEvents
    from pagedserve.worker.core.kv_cache.tiers import TierMoves

    key = lambda h: (None, (h,), None)  # noqa: E731
    assert not TierMoves() and all(TierMoves(**{name: ((1, 2),)}) for name in ("demotions", "promotions"))
    assert TierMoves(spills=(("gpu", 1, 2, ()),)) and TierMoves(loads=((b"", 1),))
    nothing = KvTiers(None, None)
    assert not nothing.demote(3, 11, key(11)) and not nothing.demote(4, 12, key(12))
    assert nothing.stats.dropped == 2 and not nothing.take_moves()
    host = KvTiers(HostTier(2), None)
    host.events = KvEvents()
    assert host.demote(3, 11, key(11)) and host.demote(4, 12, key(12)) and host.stats.demotions == 2
    assert [block for block, _ in host.take_moves().demotions] == [3, 4]
    host.on_device = lambda block_hash: block_hash == 12
    assert host.demote(5, 13, key(13)) and host.demote(6, 14, key(14))  # 11 and 12 evicted: 12 is on the device
    assert host.events.take().dropped == [11] and host.stats.demotions == 4 and host.stats.dropped == 0
    below = KvTiers(HostTier(1), DiskTier(tmp_path, "sim", 1 << 20, BLOCK * 8))
    assert below.demote(3, 21, key(21)) and not below.take_moves().spills
    assert below.demote(4, 22, key(22))  # the next step: the host's one slot goes to 22, 21 to disk
    assert below.demote(5, 23, key(23))  # the slot is this step's now: 23 goes to disk from the device
    disk = KvTiers(None, DiskTier(tmp_path / "alone", "sim", 1 << 20, BLOCK * 8))
    assert disk.demote(7, 31, key(31)) and disk.demote(8, 32, key(32))
    moves = below.take_moves()
    assert moves.spills == (("host", 0, 21, key(21)), ("gpu", 5, 23, key(23))) and below.stats.spills == 2
    assert moves.demotions == ((4, 0),) and below.stats.demotions == 2
    assert disk.take_moves().spills == (("gpu", 7, 31, key(31)), ("gpu", 8, 32, key(32))) and disk.stats.spills == 2
