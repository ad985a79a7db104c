"""KV-cache memory: contiguous reservation vs paging vs copy-on-write sharing vs prefix caching.

Runs one synthetic workload through the real scheduler and block manager (no model: the KV
bookkeeping does not depend on the token values) under the same KV budget, and reports peak
concurrent sequences, slot utilization at that peak, and the memory saved by sharing
(1 - physical blocks / logical blocks, averaged over steps, as in the PagedAttention paper).

Contiguous per-request reservation is modelled exactly as paging with one block of
``max_model_len`` slots per sequence.

    python bench/kv_memory.py [--requests 256] [--kv-tokens 131072] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass

from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.core.scheduling.config import SchedulerConfig
from pagedserve.worker.core.scheduling.plan import SampledToken, StepResult
from pagedserve.worker.core.scheduling.scheduler import Scheduler


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    max_model_len: int


def make_workload(rng: random.Random, count: int, system_prompt: int = 0) -> Workload:
    shared = [rng.randint(1, 30000) for _ in range(system_prompt)]
    prompts = [shared + [rng.randint(1, 30000) for _ in range(rng.randint(32, 1024))] for _ in range(count)]
    outs = [rng.randint(32, 512) for _ in range(count)]
    return Workload(prompts, outs, system_prompt + 1024 + 512)


def simulate(name: str, work: Workload, kv_tokens: int, block_size: int, n: int = 1, prefix: bool = False) -> dict:
    cfg = SchedulerConfig(
        num_gpu_blocks=kv_tokens // block_size, block_size=block_size, max_num_seqs=1024,
        max_num_batched_tokens=8192, max_model_len=work.max_model_len, enable_prefix_caching=prefix,
    )
    sched = Scheduler(cfg)
    for i, (prompt, out) in enumerate(zip(work.prompts, work.output_lens)):
        sched.add(str(i), prompt, SamplingParams(n=n, max_tokens=out, ignore_eos=True))
    peak, util_at_peak, saved, steps = 0, 0.0, [], 0
    started = time.perf_counter()
    while sched.has_work:
        plan = sched.schedule()
        sched.update(plan, StepResult({s.seq_id: (SampledToken(1),) * s.num_samples for s in plan.seqs if s.num_samples}))
        usage = sched.blocks.usage()
        seqs = sum(len(r.live_seqs) for r in sched.running)
        if seqs > peak:
            peak, util_at_peak = seqs, usage.slot_utilization
        if usage.used:
            saved.append(1 - usage.used / usage.logical)
        steps += 1
    return {
        "config": name,
        "block_size": block_size,
        "n": n,
        "peak_concurrent_seqs": peak,
        "slot_utilization_at_peak": round(util_at_peak, 4),
        "sharing_saving": round(sum(saved) / len(saved), 4) if saved else 0.0,
        "preemptions": sched.stats.num_preemptions,
        "prefix_hit_rate": round(sched.stats.prefix_hit_tokens / max(1, sched.stats.prefix_query_tokens), 4),
        "steps": steps,
        "sim_seconds": round(time.perf_counter() - started, 2),
    }


def simulate_beams(width: int, prompt_len: int, requests: int, max_tokens: int, block_size: int, seed: int) -> dict:
    """Peak KV blocks of beam search with copy-on-write vs the same beams holding private copies.

    No model: each beam's next-token logits are random (seeded), which drives the same forking and
    dropping of beams as a model would; the KV bookkeeping is the real scheduler's."""
    import torch

    from pagedserve.worker.runner.sampling.beam_search import BeamSearcher

    torch.manual_seed(seed)
    cfg = SchedulerConfig(num_gpu_blocks=200_000, block_size=block_size, max_num_seqs=1024,
                          max_num_batched_tokens=1 << 16, max_model_len=prompt_len + max_tokens)
    sched = Scheduler(cfg)
    rng = random.Random(seed)
    params = SamplingParams(use_beam_search=True, beam_width=width, n=1, max_tokens=max_tokens, ignore_eos=True)
    for i in range(requests):
        sched.add(str(i), [rng.randint(1, 30000) for _ in range(prompt_len)], params)
    searcher = BeamSearcher(frozenset())  # what the model runner does with real logits
    peak_physical = peak_logical = 0
    while sched.has_work:
        plan = sched.schedule()
        searcher.forget(plan.finished_request_ids)
        rows = [s for s in plan.seqs if s.num_samples]
        sched.update(plan, StepResult(beams=searcher.step(rows, torch.randn(len(rows), 1000) * 3)))
        usage = sched.blocks.usage()
        peak_physical, peak_logical = max(peak_physical, usage.used), max(peak_logical, usage.logical)
    return {"config": f"beam search, width {width}, prompt {prompt_len}", "beam_width": width, "prompt_len": prompt_len,
            "peak_blocks_cow": peak_physical, "peak_blocks_private": peak_logical,
            "saving": round(1 - peak_physical / peak_logical, 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--kv-tokens", type=int, default=131072, help="KV budget in token slots (same for every config)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    plain = make_workload(random.Random(args.seed), args.requests)
    system = make_workload(random.Random(args.seed), args.requests, system_prompt=512)
    rows = [
        simulate("contiguous (max-length reservation)", plain, args.kv_tokens, plain.max_model_len),
        simulate("paged", plain, args.kv_tokens, args.block_size),
        simulate("paged + CoW, n=4", plain, args.kv_tokens, args.block_size, n=4),
        simulate("paged + CoW, n=8", plain, args.kv_tokens, args.block_size, n=8),
        simulate("paged, 512-token system prompt, no prefix cache", system, args.kv_tokens, args.block_size),
        simulate("paged + prefix cache, 512-token system prompt", system, args.kv_tokens, args.block_size, prefix=True),
    ]
    beams = [simulate_beams(w, p, 8, 128, args.block_size, args.seed) for p in (256, 1024) for w in (2, 4, 6)]
    print(json.dumps({"bench": "kv_memory", "requests": args.requests, "kv_tokens": args.kv_tokens, "results": rows,
                      "beam_search": beams}))
    print_table(rows)
    print(f"\n{'beam search (8 requests, 128 new tokens)':<44} {'CoW peak':>9} {'private peak':>13} {'saved':>7}")
    for b in beams:
        print(f"{b['config']:<44} {b['peak_blocks_cow']:>9} {b['peak_blocks_private']:>13} {b['saving']:>7.1%}")
    return 0


def print_table(rows: list[dict]) -> None:
    head = f"{'config':<50} {'peak seqs':>9} {'slot util':>9} {'shared':>8} {'preempt':>8} {'hit rate':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['config']:<50} {r['peak_concurrent_seqs']:>9} {r['slot_utilization_at_peak']:>9.1%} "
              f"{r['sharing_saving']:>8.1%} {r['preemptions']:>8} {r['prefix_hit_rate']:>8.1%}")


if __name__ == "__main__":
    sys.exit(main())
