"""Multi-turn chats against a KV pool far smaller than their histories: time to first token with
the host and disk tiers under the prefix cache against recomputing, and the same engine on a
workload with no reuse (what the tiers cost when nothing comes back); per block of 16 tokens, what
a prompt's prefill costs against what copying a block up from a tier costs (and reading it from
disk, on the reader thread while other requests step); and a worker restarted halfway through on
the disk tier's directory, with the share of its histories it found there.

Conversations take turns in round-robin, each turn's prompt the whole history so far (earlier
prompts, outputs, a new user message), so by the time a chat speaks again the pool has evicted
its blocks. Requests run one at a time (TTFT is the prompt's own prefill, not queueing).

On a hybrid-attention model (Gemma 3) give the pool and the host tier in bytes (``--kv-bytes``,
``--host-bytes``): the ``one-table`` configurations keep every layer's KV for every position
(``--no-hybrid-kv-cache``), as the tiers needed before they kept each lane.

    python -m pagedserve.bench.kv_tiers [--chats 16] [--turns 6] [--model PATH or packaged name]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from pagedserve.bench.offline_throughput import PRESETS
from pagedserve.bench.stats import percentiles
from pagedserve.bench.table import print_table
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.source.demo_model import build_model


def first_token_seconds(engine, request_id: str, prompt: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    """(seconds to the first output token, the output) of one request run alone."""
    started, first, tokens = time.perf_counter(), None, []
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids and first is None:
                first = time.perf_counter() - started
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    return first, tokens


def run(model: Path | str, label: str, chats: int, turns: int, reuse: bool, seed: int, history: int, restart_at: int = 0,
        **engine) -> dict:
    """One configuration over the whole workload; ``restart_at``: a new engine on the same disk
    directory takes over before that turn (what a worker restarted mid-benchmark finds)."""
    from pagedserve import LLM

    llm = LLM(model, dtype="float32", **engine)
    vocab = llm.engine.info.config.vocab_size
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    histories = [[rng.randint(10, vocab - 1) for _ in range(history)] for _ in range(chats)]
    ttfts, tokens, history_tokens, started = [], 0, 0, time.perf_counter()
    restarted: dict[str, float] = {}
    for turn in range(turns):
        if turn and turn == restart_at:
            llm.engine.close()
            llm = LLM(model, dtype="float32", **engine)
            restarted = {"history": 0}
        for chat in range(chats):
            message = [rng.randint(10, vocab - 1) for _ in range(32)]
            prompt = histories[chat] + message if reuse else [rng.randint(10, vocab - 1) for _ in range(len(histories[chat]) + 32)]
            seconds, out = first_token_seconds(llm.engine, f"{chat}-{turn}", prompt, params)
            if turn:  # the first turn has no history anywhere
                ttfts.append(seconds)
                history_tokens += len(histories[chat])
            if restarted:
                restarted["history"] += len(histories[chat])
            histories[chat] = prompt + out
            tokens += len(out)
    wall = time.perf_counter() - started
    stats = llm.engine.stats()
    llm.engine.close()
    blocks_up = stats.get("kv_tier_host_hits_total", 0) + stats.get("kv_tier_disk_hits_total", 0)
    row = {"config": label, "reuse": reuse, "ttft": percentiles(ttfts), "tokens_per_s": tokens / wall,
           "prefix_hit_tokens": stats["prefix_cache_hits_total"], "tier_hit_tokens": stats.get("kv_tier_hit_tokens_total", 0),
           "host_hits": stats.get("kv_tier_host_hits_total", 0), "disk_hits": stats.get("kv_tier_disk_hits_total", 0),
           "history_tokens": history_tokens, "longest_prompt": max(len(h) for h in histories),
           # per block of 16 tokens: the mean prefill time of a prompt block, and a tier block's copy up
           "prefill_ms_per_block": 1e3 * sum(ttfts) / max(1, (history_tokens + 32 * len(ttfts)) / 16),
           "copy_up_ms_per_block": 1e3 * stats.get("kv_tier_copy_up_seconds_total", 0.0) / max(1, blocks_up),
           "disk_read_ms_per_block": 1e3 * stats.get("kv_tier_disk_read_seconds_total", 0.0) / max(1, stats.get("kv_tier_disk_hits_total", 0))}
    if restarted:  # the new engine's prefix hits over the histories it was asked to continue
        row["hit_rate_after_restart"] = stats["prefix_cache_hits_total"] / max(1, restarted["history"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model directory, GGUF file or packaged model's name (default: the llama-90m "
                        "random-weight preset)")
    parser.add_argument("--chats", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--history", type=int, default=96, help="tokens of each chat's first prompt")
    parser.add_argument("--pool-blocks", type=int, default=64, help="device KV blocks of 16 tokens")
    parser.add_argument("--host-blocks", type=int, default=1024)
    parser.add_argument("--kv-bytes", type=int, help="the device pool in bytes (instead of --pool-blocks)")
    parser.add_argument("--host-bytes", type=int, help="the host tier in bytes (instead of --host-blocks)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workloads", default="chats,no-reuse", help="which of chats, no-reuse, in this order")
    parser.add_argument("--configs", default="recompute,host,disk,host+disk,disk-restart",
                        help="which of recompute, host, disk, host+disk (a host tier of a quarter of --host-blocks "
                             "over the disk), disk-restart (a new engine on the disk tier's directory halfway), "
                             "recompute-one-table, host-one-table, in this order")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or build_model(Path(scratch) / "model", **PRESETS["llama-90m"], seed=0)
        pool = dict(kv_cache_memory=args.kv_bytes) if args.kv_bytes else dict(num_gpu_blocks=args.pool_blocks)
        host = dict(kv_offload_host_bytes=args.host_bytes) if args.host_bytes else dict(num_host_blocks=args.host_blocks)
        common = dict(**pool, block_size=16, chats=args.chats, turns=args.turns, seed=args.seed, history=args.history)
        configs = {"recompute": lambda: {}, "host": lambda: host,
                   "recompute-one-table": lambda: dict(hybrid_kv_cache=False),
                   "host-one-table": lambda: dict(**host, hybrid_kv_cache=False),
                   "disk": lambda: dict(num_host_blocks=0, kv_offload_dir=tempfile.mkdtemp(dir=scratch)),  # each run its own
                   "host+disk": lambda: dict(num_host_blocks=args.host_blocks // 4, kv_offload_dir=tempfile.mkdtemp(dir=scratch)),
                   "disk-restart": lambda: dict(num_host_blocks=0, kv_offload_dir=tempfile.mkdtemp(dir=scratch),
                                                restart_at=args.turns // 2)}
        rows = [run(model, name, reuse=workload == "chats", **common, **configs[name]())
                for workload in args.workloads.split(",") for name in args.configs.split(",")]
    for row in rows:
        print(json.dumps({"bench": "kv_tiers", **pool, **row}))
    print_table(rows, [("workload", lambda r: "chats" if r["reuse"] else "no reuse"), ("tiers", lambda r: r["config"]),
                       ("TTFT p50 ms", lambda r: r["ttft"]["p50_ms"]),
                       ("TTFT p90 ms", lambda r: r["ttft"]["p90_ms"]),
                       ("tok/s", lambda r: f"{r['tokens_per_s']:.1f}"), ("hit tokens", lambda r: r["prefix_hit_tokens"]),
                       ("from tiers", lambda r: r["tier_hit_tokens"]),
                       ("prefill ms/block", lambda r: f"{r['prefill_ms_per_block']:.2f}"),
                       ("copy up ms/block", lambda r: f"{r['copy_up_ms_per_block']:.3f}"),
                       ("disk read ms/block", lambda r: f"{r['disk_read_ms_per_block']:.3f}"),
                       ("hits after restart", lambda r: f"{r['hit_rate_after_restart']:.0%}" if "hit_rate_after_restart" in r else "")])


if __name__ == "__main__":
    main()
