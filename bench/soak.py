"""A soak: mixed traffic for a long while against a local stack (redis-server, two workers on the
demo model with a KV pool small enough to preempt and swap all the time, one gateway), watching
for what only time shows: memory or descriptors that grow, Redis keys that pile up, KV blocks that
stay held when nothing runs, requests that never end.

Traffic (``soak_traffic.py``): streamed and whole chat and completions, ``n`` > 1, beam search,
structured outputs, forced tool calls, shared prompt prefixes, the Responses and Messages APIs,
clients that leave mid-stream, deadlines that cut requests, priorities. Every ``--idle-every``
seconds the traffic pauses until the workers are idle, and then every worker's KV pool must hold
no block (the cached ones are free), the queue must be empty and the gateway must wait on no
request (``pagedserve:gateway_open_requests``). Sampled every ``--sample-s``
seconds: RSS and open descriptors of every process, Redis memory and key count.

Pass: no request failed (a 5xx, a broken stream, an exception; a 429/503 is backpressure, counted
apart), every idle point clean, and no growth: descriptors and Redis keys end the second half of the
run where they began it (within a margin) and, in runs of 10 minutes or more, each process's RSS
grows less than ``--rss-mb-per-min`` over the second half (shorter runs are warm-up: a worker's RSS
rises with each new batch shape its kernels meet). ``--minutes 3`` is the CI variant
(tests/bench/test_soak.py).

    python -m pagedserve.bench.soak [--minutes 30] [--users 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass, field

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.bench.soak_traffic import Outcomes, user
from pagedserve.bench.table import print_table
from pagedserve.stack import LocalStack

RSS_AFTER_MIN = 10  # shorter runs are warm-up (each new batch shape's kernels): their RSS is reported, not judged
WORKER_ARGS = ("--num-gpu-blocks", "40", "--preemption-mode", "swap", "--swap-space", "1", "--max-num-seqs", "12",
               "--dtype", "float32")


@dataclass
class Samples:
    """What was sampled, by time (seconds from the start)."""
    times: list[float] = field(default_factory=list)
    rss_mb: dict[str, list[float]] = field(default_factory=dict)
    fds: dict[str, list[int]] = field(default_factory=dict)
    redis_mb: list[float] = field(default_factory=list)
    redis_keys: list[int] = field(default_factory=list)

    def take(self, at: float, processes: dict[str, int], store: redis.Redis) -> None:
        self.times.append(at)
        for name, pid in processes.items():
            self.rss_mb.setdefault(name, []).append(rss_mb(pid))
            self.fds.setdefault(name, []).append(len(os.listdir(f"/proc/{pid}/fd")))
        self.redis_mb.append(store.info("memory")["used_memory"] / 2**20)
        self.redis_keys.append(store.dbsize())


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def slope_per_min(times: list[float], values: list[float]) -> float:
    """Least-squares slope of ``values`` over ``times`` (seconds), per minute; 0 for fewer than 3."""
    if len(times) < 3:
        return 0.0
    n, mt, mv = len(times), sum(times) / len(times), sum(values) / len(values)
    var = sum((t - mt) ** 2 for t in times)
    return 60 * sum((t - mt) * (v - mv) for t, v in zip(times, values)) / var if var else 0.0


def metrics(url: str) -> dict[str, float]:
    """The gateway's /metrics, sample name -> value summed over label sets (the workers' series combined)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


async def idle_point(url: str, timeout: float = 60.0) -> dict:
    """Wait until nothing runs, waits or is queued; then the KV blocks held and the requests the
    gateway still waits on (must be none)."""
    deadline = time.monotonic() + timeout
    while True:
        m = await asyncio.to_thread(metrics, url)
        busy = m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0) \
            + m.get("pagedserve:queue_depth", 0) + m.get("pagedserve:num_requests_swapped", 0)
        waited_on = m.get("pagedserve:gateway_open_requests", 0.0)
        if (busy == 0 and waited_on == 0) or time.monotonic() > deadline:
            return {"busy": busy, "kv_usage": m.get("vllm:kv_cache_usage_perc", 0.0), "gateway_open": waited_on,
                    "clean": busy == 0 and m.get("vllm:kv_cache_usage_perc", 0.0) == 0.0 and waited_on == 0}
        await asyncio.sleep(0.5)


async def run(stack: LocalStack, args: argparse.Namespace) -> dict:
    processes = {f"{c.args[3]}-{i}": c.pid for i, c in enumerate(stack.children)}
    processes["redis"] = stack.redis.proc.pid
    store = redis.Redis.from_url(stack.redis.url)
    samples, outcomes, idles = Samples(), Outcomes(), []
    go = asyncio.Event()
    go.set()
    started = time.monotonic()
    end = started + 60 * args.minutes
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as http:
        users = [asyncio.create_task(user(http, stack.served_model_name, i, go, end, outcomes)) for i in range(args.users)]
        next_sample, next_idle = started, started + args.idle_every
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_sample:
                samples.take(now - started, processes, store)
                next_sample += args.sample_s
            if now >= next_idle:
                go.clear()
                idles.append(await idle_point(stack.url))
                go.set()
                next_idle = time.monotonic() + args.idle_every
            await asyncio.sleep(0.2)
        await asyncio.gather(*users)
    idles.append(await idle_point(stack.url))
    samples.take(time.monotonic() - started, processes, store)
    return verdict(samples, outcomes, idles, args)


def verdict(samples: Samples, outcomes: Outcomes, idles: list[dict], args: argparse.Namespace) -> dict:
    half = len(samples.times) // 2
    later = samples.times[half:]
    growth = {name: round(slope_per_min(later, values[half:]), 2) for name, values in samples.rss_mb.items()}
    fds = {name: values[-1] - values[half] for name, values in samples.fds.items()}
    keys = samples.redis_keys[-1] - samples.redis_keys[half]
    checks = {
        "no request failed": outcomes.counts.get("failed", 0) == 0,
        "every idle point clean": all(i["clean"] for i in idles),
        "no RSS growth": args.minutes < RSS_AFTER_MIN or all(g < args.rss_mb_per_min for g in growth.values()),
        "no descriptor growth": all(d <= 8 for d in fds.values()),
        "no Redis key growth": keys <= 16,
    }
    return {"passed": all(checks.values()), "checks": checks, "requests": outcomes.counts,
            "failures": outcomes.failures[:10], "idle_points": len(idles), "unclean_idle": [i for i in idles if not i["clean"]],
            "rss_mb_start": {n: round(v[0], 1) for n, v in samples.rss_mb.items()},
            "rss_mb_end": {n: round(v[-1], 1) for n, v in samples.rss_mb.items()},
            "rss_mb_per_min_second_half": growth, "fd_change_second_half": fds,
            "redis_keys": [samples.redis_keys[0], samples.redis_keys[half], samples.redis_keys[-1]],
            "redis_mb": [round(samples.redis_mb[0], 2), round(samples.redis_mb[-1], 2)], "samples": len(samples.times),
            "rss_mb_series": {n: [round(x) for x in v] for n, v in samples.rss_mb.items()},
            "sample_times_s": [round(t) for t in samples.times]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--users", type=int, default=8, help="clients sending one request after another")
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--idle-every", type=float, default=60.0, help="seconds between idle points")
    parser.add_argument("--rss-mb-per-min", type=float, default=2.0, help="the RSS growth that fails the run")
    args = parser.parse_args(argv)
    with LocalStack(model="demo", workers=2, extra_worker_args=WORKER_ARGS) as stack:
        result = asyncio.run(run(stack, args))
    print(json.dumps({"bench": "soak", "minutes": args.minutes, "users": args.users, **result}))
    rows = [{"process": name, "start": result["rss_mb_start"][name], "end": result["rss_mb_end"][name],
             "slope": result["rss_mb_per_min_second_half"][name], "fds": result["fd_change_second_half"][name]}
            for name in result["rss_mb_start"]]
    print_table(rows, [("process", lambda r: r["process"]), ("RSS MB start", lambda r: r["start"]),
                       ("RSS MB end", lambda r: r["end"]), ("MB/min (2nd half)", lambda r: r["slope"]),
                       ("fds +/- (2nd half)", lambda r: r["fds"])])
    print(f"requests {result['requests']}  idle points {result['idle_points']}  redis keys {result['redis_keys']}  "
          f"checks {result['checks']}  -> {'PASS' if result['passed'] else 'FAIL'}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
