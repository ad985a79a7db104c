"""Scale-out measured by simulation: 1 to 32 simulated workers against one Redis, ``shared`` vs
``prefix`` routing, on a shared-system-prompt workload and a multi-turn chat workload.

    python -m bench.scale --calibrate                  # fit the step cost to the real model here
    python -m bench.scale [--workers 1,2,4,8,16,32] [--seconds 10] [--slowdown 10] [--cost B,S,T]

Workers (``bench/sim_workers.py``, eight per process) run the real scheduler, block manager,
prefix cache, KV events and Redis I/O; each step sleeps what the demo model's step costs on this
machine (``--calibrate`` fits ``base + per_seq x seqs + per_token x tokens`` by least squares)
times ``--slowdown``, so that 32 workers' Python stays a small part of two cores. Requests are sent
as the gateway sends them (``gateway/routing/router.py`` with the KV index, the reply dispatcher), without
HTTP: the gateway's HTTP cost is not what is measured. Closed loop, ``--clients-per-worker``
concurrent clients per worker. Per run: output tokens/s, TTFT p50/p99, the prefix hit rate (hit
over looked-up prompt tokens, from the workers' metrics) and Redis CPU (its own counters: all
nodes, and the busiest). ``--cluster``: the same on a three-master Redis Cluster. Prints a JSON
line and a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aioredis

from pagedserve.bench.table import print_table
from pagedserve.embedded_redis import RedisClusterServers, RedisServer
from pagedserve.gateway.routing.router import Router, RoutingPolicy
from pagedserve.gateway.routing.worker_directory import WorkerDirectory
from pagedserve.runtime.producer import Producer
from pagedserve.runtime.redis_client import connect
from pagedserve.runtime.replies import ReplyDispatcher
from pagedserve.shared.keys import Keys
from pagedserve.shared.protocol import ReplyTarget, WireRequest
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.source.resolve import model_or_default

MODEL = "demo"
KEYS = Keys()
PER_PROCESS = 8
SYSTEM_PROMPTS = 48  # x 256 tokens: 12,288 tokens, more than one worker's cache (--num-gpu-blocks 512: 8,192)
VOCAB = (20, 500)  # token ids the workloads draw from


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calibrate", action="store_true", help="fit the step cost to the demo model and print it")
    p.add_argument("--workers", default="1,2,4,8,16,32")
    p.add_argument("--seconds", type=float, default=15.0, help="measured time per run")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of the same load before the measured time")
    p.add_argument("--slowdown", type=float, default=5.0, help="the calibrated step cost times this")
    p.add_argument("--cost", default=None, help="BASE,PER_SEQ,PER_TOKEN seconds (default: calibrate now)")
    p.add_argument("--clients-per-worker", type=int, default=6)
    p.add_argument("--workloads", default="shared-prompt,multi-turn")
    p.add_argument("--routings", default="shared,prefix")
    p.add_argument("--cluster", action="store_true", help="a three-master Redis Cluster instead of one redis-server")
    p.add_argument("--imbalance", type=int, default=RoutingPolicy.imbalance, help="the router's --routing-imbalance")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------- calibration
def calibrate() -> str:
    """Time real engine steps of the demo model (decodes at several batch sizes, prefills of
    several lengths) and fit the step cost."""
    import numpy as np

    from pagedserve import LLM

    llm = LLM(model_or_default(MODEL), device="cpu", dtype="float32", num_gpu_blocks=4096, enable_prefix_caching=False)
    engine, rows, seconds = llm.engine, [], []
    rng = random.Random(0)
    for batch, prompt_len in ((1, 16), (4, 16), (16, 16), (32, 16), (1, 256), (2, 512), (1, 1024)):
        for i in range(batch):
            engine.add_request(f"c{batch}-{prompt_len}-{i}", [rng.randint(*VOCAB) for _ in range(prompt_len)],
                               SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        while engine.has_unfinished():  # each step's forward, timed on its own (Engine.last_forward)
            engine.step()
            if engine.last_forward.seqs:
                seconds.append(engine.last_forward.seconds)
                rows.append((1.0, float(engine.last_forward.seqs), float(engine.last_forward.tokens)))
    a = np.array(rows)
    coef, *_ = np.linalg.lstsq(a, np.array(seconds), rcond=None)
    base, per_seq, per_token = (max(0.0, float(c)) for c in coef)
    return f"{base:.6f},{per_seq:.6f},{per_token:.7f}"


# ---------------------------------------------------------------------------------------- workloads
@dataclass
class Workload:
    """What one closed-loop client sends next, from what it got back."""

    name: str
    rng: random.Random
    systems: list[list[int]] = field(default_factory=list)
    history: list[int] = field(default_factory=list)
    turn: int = 0

    def next_prompt(self, last_output: list[int]) -> list[int]:
        tokens = lambda n: [self.rng.randint(*VOCAB) for _ in range(n)]  # noqa: E731
        if self.name == "shared-prompt":
            return self.rng.choice(self.systems) + tokens(16)
        if self.turn == 0 or self.turn >= 8:  # a new conversation: 128 tokens, then 7 more turns of 32
            self.history, self.turn = tokens(128), 1
            return list(self.history)
        self.history = self.history + last_output + tokens(32)
        self.turn += 1
        return list(self.history)


@dataclass
class RunResult:
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    requests: int = 0
    errors: int = 0


async def client(workload: Workload, router: Router, dispatcher: ReplyDispatcher, measure_from: float,
                 stop_at: float, result: RunResult, max_tokens: int) -> None:
    last: list[int] = []
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    while time.monotonic() < stop_at:
        prompt = workload.next_prompt(last)
        request = WireRequest(id=f"r{random.getrandbits(64):x}", model=MODEL, params=params,
                              reply=ReplyTarget("channel", dispatcher.channel), prompt_token_ids=prompt)
        box = dispatcher.open(request)
        stream = await router.route(prompt, None)
        sent = time.monotonic()
        await dispatcher.send([box], [stream])
        first, last = None, []
        async for event in box.events():
            if event.error:
                result.errors += 1
                break
            now = time.monotonic()
            if first is None and event.outputs:
                first = now - sent
            new = [t for o in event.outputs for t in o.token_ids]
            last.extend(new)
            if measure_from <= now <= stop_at:  # throughput: tokens that arrived in the measured time
                result.tokens += len(new)
        dispatcher.close(box)
        if first is not None and not event.error and measure_from <= sent <= stop_at:
            result.ttft.append(first)
            result.requests += 1


async def worker_totals(r: aioredis.Redis) -> tuple[float, float]:
    hits = queries = 0.0
    async for key in r.scan_iter(match=KEYS.metrics(MODEL, "*"), count=100):
        h, q = await r.hmget(key, "prefix_cache_hits_total", "prefix_cache_queries_total")
        hits, queries = hits + float(h or 0), queries + float(q or 0)
    return hits, queries


async def redis_cpu(ports: list[int]) -> list[float]:
    """CPU seconds each Redis node has used (a cluster's nodes one by one)."""
    used = []
    for port in ports:
        node = aioredis.Redis(port=port)
        info = await node.info("cpu")
        used.append(float(info["used_cpu_sys"]) + float(info["used_cpu_user"]))
        await node.aclose()
    return used


async def run_one(url: str, ports: list[int], workers: int, workload_name: str, routing: str, warmup: float,
                  seconds: float, clients_per_worker: int, seed: int, imbalance: int) -> dict:
    r = connect(url, blocking_pool=True, max_connections=64, timeout=30)
    router = Router(WorkerDirectory(r, KEYS), KEYS, MODEL, RoutingPolicy(routing, imbalance=imbalance))
    stop_index = asyncio.Event()
    index_task = asyncio.create_task(router.index.follow(connect(url), KEYS.kv_events(MODEL), stop_index))
    dispatcher = ReplyDispatcher(r, KEYS.replies(f"bench-{seed}"), Producer(r, KEYS))
    await dispatcher.start()
    rng = random.Random(seed)
    systems = [[rng.randint(*VOCAB) for _ in range(256)] for _ in range(SYSTEM_PROMPTS)]
    loads = [Workload(workload_name, random.Random(seed * 1000 + i), systems) for i in range(workers * clients_per_worker)]
    result = RunResult()
    measure_from = time.monotonic() + warmup
    stop_at = measure_from + seconds
    clients = asyncio.gather(*(client(w, router, dispatcher, measure_from, stop_at, result, 16) for w in loads))
    await asyncio.sleep(warmup - 1.0)
    hits0, queries0 = await worker_totals(r)  # as of the last heartbeat, about a second before the measured time
    await asyncio.sleep(max(0.0, measure_from - time.monotonic()))
    cpu0, wall0 = await redis_cpu(ports), time.monotonic()
    await asyncio.sleep(seconds - 1.0)
    hits1, queries1 = await worker_totals(r)
    await asyncio.sleep(max(0.0, stop_at - time.monotonic()))
    wall = time.monotonic() - wall0
    cpu = [b - a for a, b in zip(cpu0, await redis_cpu(ports))]
    await clients
    stop_index.set()
    await asyncio.gather(index_task, return_exceptions=True)
    await dispatcher.stop()
    await r.aclose()
    ttft = sorted(result.ttft) or [float("nan")]
    return {
        "workers": workers, "workload": workload_name, "routing": routing, "requests": result.requests,
        "errors": result.errors, "tokens_per_s": round(result.tokens / wall, 1),
        "ttft_p50_ms": round(1000 * ttft[len(ttft) // 2], 1), "ttft_p99_ms": round(1000 * ttft[int(len(ttft) * 0.99)], 1),
        "hit_rate": round((hits1 - hits0) / max(1.0, queries1 - queries0), 3), "redis_cpu": round(sum(cpu) / wall, 3),
        "busiest_node_cpu": round(max(cpu) / wall, 3),
    }


def start_workers(url: str, count: int, cost: str) -> list[subprocess.Popen]:
    names = [f"sim{i}" for i in range(count)]
    procs = []
    for start in range(0, count, PER_PROCESS):
        procs.append(subprocess.Popen([sys.executable, "-m", "pagedserve.bench.sim_workers", "--redis-url", url, "--names",
                                       ",".join(names[start:start + PER_PROCESS]), "--simulate", cost,
                                       "--num-gpu-blocks", "512"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


async def wait_for_workers(url: str, count: int, timeout: float = 300) -> None:
    r = connect(url)
    deadline = time.monotonic() + timeout
    while len([k async for k in r.scan_iter(match=KEYS.metrics(MODEL, "*"))]) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"only some of the {count} simulated workers came up in {timeout} s")
        await asyncio.sleep(0.5)
    await r.aclose()


def scaled(cost: str, factor: float) -> str:
    return ",".join(f"{float(part) * factor:.7f}" for part in cost.split(","))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.calibrate:
        print(calibrate())
        return
    cost = scaled(args.cost or calibrate(), args.slowdown)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        server = (RedisClusterServers(Path(tmp)) if args.cluster else RedisServer(Path(tmp))).start()
        ports = [node.port for node in server.nodes] if args.cluster else [server.port]
        try:
            for count in (int(n) for n in args.workers.split(",")):
                procs = start_workers(server.url, count, cost)
                try:
                    asyncio.run(wait_for_workers(server.url, count))
                    for workload in args.workloads.split(","):
                        for routing in args.routings.split(","):
                            row = asyncio.run(run_one(server.url, ports, count, workload, routing, args.warmup, args.seconds,
                                                      args.clients_per_worker, len(rows) + 1, args.imbalance))
                            rows.append(row)
                            print(json.dumps(row), file=sys.stderr)
                finally:
                    for proc in procs:
                        proc.terminate()
                    for proc in procs:
                        proc.wait(60)
        finally:
            server.stop()
    print(json.dumps({"bench": "scale", "step_cost": cost, "slowdown": args.slowdown, "seconds": args.seconds,
                      "warmup": args.warmup, "imbalance": args.imbalance, "cluster": args.cluster,
                      "clients_per_worker": args.clients_per_worker, "results": rows}))
    print_table(rows, [("workers", lambda r: r["workers"]), ("workload", lambda r: r["workload"]),
                       ("routing", lambda r: r["routing"]), ("req", lambda r: r["requests"]),
                       ("tok/s", lambda r: r["tokens_per_s"]), ("ttft p50 ms", lambda r: r["ttft_p50_ms"]),
                       ("ttft p99 ms", lambda r: r["ttft_p99_ms"]), ("hit rate", lambda r: r["hit_rate"]),
                       ("redis cpu", lambda r: r["redis_cpu"]), ("busiest node", lambda r: r["busiest_node_cpu"]),
                       ("errors", lambda r: r["errors"])])
    print(f"step cost (x{args.slowdown:g}): {cost}; {statistics.fmean(r['redis_cpu'] for r in rows):.3f} Redis cores on average")


if __name__ == "__main__":
    main()
