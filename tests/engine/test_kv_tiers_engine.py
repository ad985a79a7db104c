"""The tiers under the prefix cache on the real engine (model, runner, pools of bytes): prompts
whose prefixes the pool evicted come back from the host tier or from disk with the tokens
transformers gives; a worker restarted on the directory starts warm; damaged files recompute."""

from __future__ import annotations

import random

import pytest

from pagedserve import LLM
from pagedserve.shared.sampling import SamplingParams
from tests.engine.test_parity import run_checked

MODEL = "llama-gqa"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def prompts(count: int = 5, length: int = 70) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randint(10, 500) for _ in range(length)] for _ in range(count)]


def tiered(zoo, **tiers) -> LLM:
    """A pool of 12 blocks of 16: one prompt of 70 tokens and its output fit, the next evicts it."""
    return LLM(zoo.path(MODEL), device="cpu", dtype="float32", num_gpu_blocks=12, block_size=16, **tiers)


def one_at_a_time(llm: LLM, zoo, rounds: list[list[int]]) -> None:
    """Each prompt alone (invariants every step), its tokens equal to transformers'."""
    disk = llm.engine.scheduler.blocks.tiers.disk
    for prompt in rounds:
        done = run_checked(llm, [prompt], [GREEDY])
        assert done[0].outputs[0].token_ids == zoo.hf_greedy(MODEL, prompt, 6)
        if disk is not None:
            disk.flush()  # the spills of this prompt on disk before the next one looks


@pytest.mark.parametrize("tiers", [dict(num_host_blocks=32), dict(kv_offload_dir="disk"),
                                   dict(num_host_blocks=3, kv_offload_dir="disk")], ids=["host", "disk", "host+disk"])
def test_evicted_prefixes_come_back_from_below_with_transformers_tokens(zoo, tmp_path, tiers):
    if "kv_offload_dir" in tiers:
        tiers["kv_offload_dir"] = str(tmp_path / "disk")
    llm = tiered(zoo, **tiers)
    batch = prompts()
    one_at_a_time(llm, zoo, batch + batch)
    stats = llm.engine.stats()
    assert stats["kv_tier_hit_tokens_total"] >= 4 * 4 * 16  # the second round: four full blocks of each prompt
    assert stats["prefix_cache_hits_total"] == stats["kv_tier_hit_tokens_total"]  # the pool itself kept none
    assert stats.get("kv_tier_disk_corrupt_total", 0) == stats.get("kv_tier_disk_skipped_total", 0) == 0


def test_without_tiers_the_second_round_recomputes(zoo):
    llm = tiered(zoo)
    batch = prompts()
    for prompt in batch + batch:
        run_checked(llm, [prompt], [GREEDY])
    assert llm.engine.stats()["prefix_cache_hits_total"] == 0


def test_a_restarted_engine_serves_the_last_ones_prefixes_from_disk(zoo, tmp_path):
    first = tiered(zoo, kv_offload_dir=str(tmp_path))
    batch = prompts()
    one_at_a_time(first, zoo, batch)
    first.engine.scheduler.blocks.tiers.disk.close()  # killed: what it had not spilled is lost
    again = tiered(zoo, kv_offload_dir=str(tmp_path))
    one_at_a_time(again, zoo, batch[:2])
    assert again.engine.stats()["kv_tier_disk_hits_total"] == 2 * 4


@pytest.mark.parametrize("host,count", [(0, 2), (32, 3)])
def test_an_engine_closed_writes_back_what_only_its_device_and_host_held(zoo, tmp_path, host, count):
    first = tiered(zoo, kv_offload_dir=str(tmp_path), num_host_blocks=host)
    batch = prompts(count)  # two fit in the pool; a third sends the first to the host tier
    one_at_a_time(first, zoo, batch)
    stats = first.engine.stats()
    assert stats["kv_tier_spills_total"] == 0 and (stats["kv_tier_demotions_total"] > 0) == bool(host)
    first.engine.close()
    again = tiered(zoo, kv_offload_dir=str(tmp_path))
    one_at_a_time(again, zoo, batch)
    assert again.engine.stats()["kv_tier_disk_hits_total"] == count * 4


def test_damaged_files_are_recomputed_never_served(zoo, tmp_path):
    first = tiered(zoo, kv_offload_dir=str(tmp_path))
    batch = prompts()
    one_at_a_time(first, zoo, batch)
    files = sorted(tmp_path.glob("*/*.kv"))
    assert files
    for path in files:  # one flipped bit of K or V in every block
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x10
        path.write_bytes(bytes(data))
    again = tiered(zoo, kv_offload_dir=str(tmp_path))
    one_at_a_time(again, zoo, batch)
    stats = again.engine.stats()
    assert stats["kv_tier_disk_hits_total"] == 0 and stats["kv_tier_disk_corrupt_total"] >= 2  # the first block of each prompt that was spilled


def test_the_kv_events_say_which_blocks_left_the_device_for_a_tier(zoo, tmp_path):
    """What prefix routing learns: evicted blocks the host tier keeps are lowered, not dropped, and
    a resync lists them apart from the device's."""
    from pagedserve.worker.core.kv_cache.kv_events import KvEvents
    from pagedserve.worker.serve.loop import EngineLoop

    llm = tiered(zoo, num_host_blocks=32)
    events = KvEvents()
    llm.engine.record_kv_events(events)
    one_at_a_time(llm, zoo, prompts(3))  # the third evicts the first
    changes = events.take()
    lowered = set(llm.engine.lowered_hashes())
    assert lowered and lowered == set(changes.lowered) and not changes.dropped
    assert not lowered & set(llm.engine.cached_hashes())
    sent = []
    loop = EngineLoop(llm.engine, lambda outputs, errors: None, on_kv=sent.append)
    loop.resync_kv()
    loop.finish()
    loop.run()
    assert [(set(c.published), set(c.lowered), c.reset) for c in sent] == [(set(llm.engine.cached_hashes()), lowered, True)]


def test_the_tiers_sized_in_bytes_hold_what_their_bytes_buy(zoo, tmp_path):
    """``--kv-offload-host-bytes`` and ``--kv-offload-disk-bytes`` (every other test sizes the tiers in
    blocks): the host tier takes whole blocks of the pool's size, the disk tier stays under its bound."""
    block_bytes = tiered(zoo).engine.kv_bytes_per_token * 16
    llm = tiered(zoo, kv_offload_host_bytes=5 * block_bytes + block_bytes // 2, kv_offload_dir=str(tmp_path),
                 kv_offload_disk_bytes=3 * block_bytes + 512)
    tiers = llm.engine.scheduler.blocks.tiers
    assert tiers.host.num_slots == 5 and tiers.disk.max_bytes == 3 * block_bytes + 512
    one_at_a_time(llm, zoo, prompts(4) + prompts(4))
    assert 0 < tiers.disk.num_bytes <= 3 * block_bytes + 512 and len(tiers.host) == 5
    assert llm.engine.stats()["kv_tier_hit_tokens_total"] > 0


@pytest.mark.parametrize("first, second", [(dict(kv_cache_dtype="int8"), dict(kv_cache_dtype="fp8_e4m3")),
                                           (dict(), dict(quantization="int8"))], ids=["cache format", "weights"])
def test_an_engine_of_another_cache_format_or_weights_never_reads_the_directorys_blocks(zoo, tmp_path, first, second):
    """int8 and fp8 rows have one layout, and int8 weights write other KV than float ones: an engine
    that differs in either starts on a folder of its own (the fingerprint); one alike finds the blocks."""
    from tests.engine.test_parity import run_checked

    writer = tiered(zoo, kv_offload_dir=str(tmp_path), **first)
    for prompt in prompts(3):
        run_checked(writer, [prompt], [GREEDY])
    writer.engine.close()  # what only its device held is written back
    written = len(writer.engine.scheduler.blocks.tiers.disk)
    other = tiered(zoo, kv_offload_dir=str(tmp_path), **second).engine.scheduler.blocks.tiers.disk
    alike = tiered(zoo, kv_offload_dir=str(tmp_path), **first).engine.scheduler.blocks.tiers.disk
    assert written > 0 and len(other) == 0 and len(alike) == written and other.root != alike.root
