"""What the KV dashboard costs a worker: the engine thread's time to take one snapshot
(``worker/core/scheduling/kv_snapshot.py``) and its msgpack size, by pool size, with the pool half held by
running requests (a quarter of them forked into three samples, so there is sharing to draw).

The worker takes one every ``dashboard_interval_s`` (0.25 s), but never more than 2% of the engine
thread (``worker/serve/dashboard_publisher.ENGINE_SHARE``): the ``engine share`` column is what
that rule leaves at each size. Nothing is taken while no dashboard is open.

    python -m bench.dashboard_snapshot [--blocks 1024,16384,65536,262144,1048576] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import time

import msgpack

from pagedserve.bench.table import print_table
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.core.scheduling.config import SchedulerConfig
from pagedserve.worker.core.scheduling.kv_snapshot import SNAPSHOT_BUDGET, kv_snapshot
from pagedserve.worker.core.scheduling.scheduler import Scheduler
from pagedserve.worker.serve.dashboard_publisher import ENGINE_SHARE

INTERVAL_S = 0.25
BLOCK_SIZE = 16


def half_full(num_blocks: int, num_requests: int) -> Scheduler:
    """A scheduler whose running requests hold about half the pool (one prefill step planned)."""
    prompt = max(BLOCK_SIZE, num_blocks // 2 // num_requests * BLOCK_SIZE)
    config = SchedulerConfig(num_gpu_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=4 * num_requests,
                             max_num_batched_tokens=prompt * num_requests, max_model_len=prompt + 64)
    sched = Scheduler(config)
    for i in range(num_requests):
        sched.add(f"cmpl-{i:032x}", [1 + i % 30_000] * prompt, SamplingParams(max_tokens=32, ignore_eos=True))
    sched.schedule()
    for req in list(sched.running)[: num_requests // 4]:  # forked, as n=3 would after its prefill
        sched.table.fork(req, req.seqs[0], 2)
    return sched


def measure(num_blocks: int, num_requests: int, repeat: int) -> dict:
    sched = half_full(num_blocks, num_requests)
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        snap = kv_snapshot(sched)
        times.append(time.perf_counter() - started)
    took = sorted(times)[len(times) // 2]
    every = max(INTERVAL_S, took / ENGINE_SHARE)
    size = len(msgpack.packb(snap))
    return {"blocks": num_blocks, "requests": num_requests, "snapshot_ms": round(1000 * took, 2),
            "bytes": size, "budget_bytes": SNAPSHOT_BUDGET, "every_s": round(every, 2),
            "engine_share": round(took / every, 4), "kb_per_s": round(size / every / 1024, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", default="1024,16384,65536,262144,1048576")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    rows = [measure(int(n), args.requests, args.repeat) for n in args.blocks.split(",")]
    print(json.dumps({"bench": "dashboard_snapshot", "requests": args.requests, "results": rows}))
    print_table(rows, [("blocks", lambda r: r["blocks"]), ("requests", lambda r: r["requests"]),
                       ("snapshot ms", lambda r: r["snapshot_ms"]), ("bytes", lambda r: r["bytes"]),
                       ("budget", lambda r: r["budget_bytes"]), ("one every s", lambda r: r["every_s"]),
                       ("engine share", lambda r: f"{100 * r['engine_share']:.2f} %"),
                       ("KiB/s", lambda r: r["kb_per_s"])])


if __name__ == "__main__":
    main()
