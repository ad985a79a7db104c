"""Overload: ten times what the stack admits, in one burst, against a local stack (redis-server,
two workers on the demo model, one gateway with ``--max-queue-depth``).

What must hold: the model's streams never hold more than ``--max-queue-depth`` entries (queued
and running); every request past it is answered 429 with ``Retry-After`` and never reaches a
stream (Redis's ``entries-added`` counts exactly the admitted ones, so no worker did any work for
the rest); no request fails otherwise (no 5xx, no broken answer, none ended at its ``timeout``: the
deadline every request carries, so nothing waits forever); every admitted request gets all its
tokens; no process's
memory runs away (peak RSS under ``--rss-growth`` x its RSS before the burst); afterwards the
queue drains to nothing and a request is answered as fast as before (reported, judged only here).

    python -m pagedserve.bench.overload [--depth 24] [--times 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass

import httpx
import redis

from pagedserve.bench.soak import rss_mb, idle_point
from pagedserve.bench.table import print_table
from pagedserve.shared.keys import Keys
from pagedserve.stack import LocalStack

PROMPT = "Tell me about the sea, the wind and the boats that cross it."


@dataclass
class Answer:
    status: int
    seconds: float
    retry_after: str | None = None
    tokens: int = 0
    error: str = ""


async def ask(http: httpx.AsyncClient, model: str, max_tokens: int, timeout_s: float, stream: bool) -> Answer:
    """One completion (streamed or not); its status, time and tokens, or what went wrong."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "timeout": timeout_s,
            "temperature": 0.0, "stream": stream}
    started = time.monotonic()
    try:
        if not stream:
            r = await http.post("/v1/completions", json=body)
            tokens = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
            return Answer(r.status_code, time.monotonic() - started, r.headers.get("Retry-After"), tokens,
                          "" if r.status_code in (200, 429) else r.text[:200])
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return Answer(r.status_code, time.monotonic() - started, r.headers.get("Retry-After"),
                              error="" if r.status_code == 429 else r.text[:200])
            chunks, done = 0, False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return Answer(200, time.monotonic() - started, error=str(chunk["error"])[:200])
                    chunks += 1
            return Answer(200, time.monotonic() - started, tokens=chunks, error="" if done else "no [DONE]")
    except (httpx.HTTPError, ValueError, KeyError) as err:
        return Answer(0, time.monotonic() - started, error=f"{type(err).__name__}: {err}")


def model_streams(store: redis.Redis, keys: Keys, model: str) -> list[str]:
    """The model's shared stream and every worker's own (routed) stream."""
    return [keys.requests(model), *sorted(k.decode() for k in store.scan_iter(match=keys.routed_pattern(model)))]


def entries_added(store: redis.Redis, streams: list[str]) -> int:
    """Entries ever added to ``streams`` (Redis 7's ``entries-added``)."""
    return sum(store.xinfo_stream(s)["entries-added"] for s in streams if store.exists(s))


async def watch(store: redis.Redis, keys: Keys, model: str, processes: dict[str, int], stop: asyncio.Event) -> tuple[int, dict]:
    """Until ``stop``: the most entries the model's streams held at once, and each process's peak RSS."""
    deepest, peak = 0, {name: 0.0 for name in processes}
    while not stop.is_set():
        streams = await asyncio.to_thread(model_streams, store, keys, model)
        deepest = max(deepest, sum(await asyncio.to_thread(lambda: [store.xlen(s) for s in streams])))
        for name, pid in processes.items():
            peak[name] = max(peak[name], rss_mb(pid))
        await asyncio.sleep(0.02)
    return deepest, peak


async def one_by_one(http: httpx.AsyncClient, model: str, count: int, max_tokens: int) -> list[float]:
    return [(await ask(http, model, max_tokens, 60.0, False)).seconds for _ in range(count)]


async def run(stack: LocalStack, args: argparse.Namespace) -> dict:
    keys, model = Keys(), stack.served_model_name
    store = redis.Redis.from_url(stack.redis.url)
    processes = {f"{c.args[3]}-{i}": c.pid for i, c in enumerate(stack.children)}
    limits = httpx.Limits(max_connections=args.depth * args.times + 10)
    async with httpx.AsyncClient(base_url=stack.url, timeout=args.timeout + 30, limits=limits) as http:
        await one_by_one(http, model, 2, args.max_tokens)  # warm-up
        before = await one_by_one(http, model, args.probes, args.max_tokens)
        rss_before = {name: rss_mb(pid) for name, pid in processes.items()}
        added_before = entries_added(store, model_streams(store, keys, model))
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(store, keys, model, processes, stop))
        started = time.monotonic()
        answers = await asyncio.gather(*(ask(http, model, args.max_tokens, args.timeout, i % 2 == 1)
                                         for i in range(args.depth * args.times)))
        burst_s = time.monotonic() - started
        idle = await idle_point(stack.url, timeout=args.timeout)
        drain_s = time.monotonic() - started
        stop.set()
        deepest, peak = await watcher
        added = entries_added(store, model_streams(store, keys, model)) - added_before
        after = await one_by_one(http, model, args.probes, args.max_tokens)
    return verdict(args, answers, deepest, added, idle, rss_before, peak, before, after, burst_s, drain_s)


def verdict(args, answers: list[Answer], deepest: int, added: int, idle: dict, rss_before: dict, peak: dict,
            before: list[float], after: list[float], burst_s: float, drain_s: float) -> dict:
    ok = [a for a in answers if a.status == 200 and not a.error]
    refused = [a for a in answers if a.status == 429]
    failed = [a for a in answers if a not in ok and a not in refused]
    checks = {
        "queue never past its depth": deepest <= args.depth,
        "every refusal a 429 with Retry-After": all(a.retry_after for a in refused) and len(refused) > 0,
        "refused requests never queued": added == len(ok) + len(failed),
        "no request failed": not failed,
        # (one past its deadline is ended with an error by the engine: "no request failed" says it was not)
        "admitted ones got every token": all(a.tokens >= args.max_tokens for a in ok),
        "memory bounded": all(peak[n] <= args.rss_growth * rss_before[n] for n in peak),
        "drained to idle": idle["clean"],
    }
    ms = lambda values, q: round(1000 * sorted(values)[min(len(values) - 1, int(q * len(values)))], 1) if values else None  # noqa: E731
    return {"passed": all(checks.values()), "checks": checks, "burst": len(answers), "depth": args.depth,
            "admitted": len(ok), "refused": len(refused), "failed": len(failed), "failures": [a.error for a in failed][:5],
            "deepest": deepest, "entries_added": added,
            "admitted_ms": {"p50": ms([a.seconds for a in ok], 0.5), "p99": ms([a.seconds for a in ok], 0.99)},
            "refused_ms": {"p50": ms([a.seconds for a in refused], 0.5), "p99": ms([a.seconds for a in refused], 0.99)},
            "burst_s": round(burst_s, 1), "drain_s": round(drain_s, 1),
            "one_request_ms_before": round(1000 * statistics.median(before), 1),
            "one_request_ms_after": round(1000 * statistics.median(after), 1),
            "rss_mb_before": {n: round(v) for n, v in rss_before.items()}, "rss_mb_peak": {n: round(v) for n, v in peak.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=24, help="the gateway's --max-queue-depth")
    parser.add_argument("--times", type=int, default=10, help="the burst, in multiples of the depth")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=120.0, help="every request's timeout (its deadline)")
    parser.add_argument("--probes", type=int, default=5, help="single requests timed before and after")
    parser.add_argument("--rss-growth", type=float, default=1.5, help="the peak RSS over the RSS before that fails")
    args = parser.parse_args(argv)
    worker_args = ("--max-num-seqs", str(args.max_num_seqs), "--dtype", "float32")
    with LocalStack(model="demo", workers=args.workers, extra_worker_args=worker_args,
                    extra_gateway_args=("--max-queue-depth", str(args.depth))) as stack:
        result = asyncio.run(run(stack, args))
    print(json.dumps({"bench": "overload", **result}))
    print_table([{"what": "admitted", "count": result["admitted"], **result["admitted_ms"]},
                 {"what": "refused (429)", "count": result["refused"], **result["refused_ms"]},
                 {"what": "failed", "count": result["failed"], "p50": None, "p99": None}],
                [("", lambda r: r["what"]), ("requests", lambda r: r["count"]), ("p50 ms", lambda r: r["p50"]),
                 ("p99 ms", lambda r: r["p99"])])
    print(f"burst {result['burst']} against a depth of {result['depth']}: deepest {result['deepest']}, "
          f"entries added {result['entries_added']}, drained in {result['drain_s']} s; one request "
          f"{result['one_request_ms_before']} ms before, {result['one_request_ms_after']} ms after; "
          f"peak RSS {result['rss_mb_peak']} (before {result['rss_mb_before']})  -> {'PASS' if result['passed'] else 'FAIL'}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
