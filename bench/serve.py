"""Serving benchmark against an OpenAI-compatible endpoint, in the manner of ``vllm bench serve``.

Requests arrive as a Poisson process at ``--rate`` per second (``inf``: all at once, a burst) from a
random dataset or a shared-prefix one (every prompt starts with the same long system text).
Reports request throughput, output tokens/s, TTFT, TPOT, ITL and end-to-end latency
(p50/p90/p99) and goodput: requests/s that met the SLO (``--slo-ttft-ms``, ``--slo-tpot-ms``).

Without ``--url`` it starts a throw-away stack (redis-server, a worker and a gateway on the demo model).

    python -m bench.serve [--url http://127.0.0.1:8000] [--rate 8] [--requests 100] [--dataset shared-prefix]
                          [--dashboard 3]   (that many KV dashboards open meanwhile: what watching costs)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import dataclass, field

import aiohttp

from pagedserve.bench.stats import percentiles


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / max(1, self.output_tokens - 1)


def dataset(kind: str, count: int, seed: int, vocab: int = 400) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    system = [rng.randint(10, vocab) for _ in range(256)] if kind == "shared-prefix" else []
    return [(system + [rng.randint(10, vocab) for _ in range(rng.randint(16, 256))], rng.randint(16, 128))
            for _ in range(count)]


async def one(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result, start, last = Result(), time.perf_counter(), None
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                return Result(error=f"HTTP {r.status}: {(await r.text())[:200]}")
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(error=chunk["error"]["message"])
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["text"]:
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency, result.ok = time.perf_counter() - start, True
    except aiohttp.ClientError as err:
        result.error = str(err)
    return result


async def run(args) -> dict:
    rng = random.Random(args.seed)
    work = dataset(args.dataset, args.requests, args.seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        viewers = [asyncio.create_task(watch_dashboard(session, args.url)) for _ in range(args.dashboard)]
        tasks, start = [], time.perf_counter()
        for prompt, max_tokens in work:
            tasks.append(asyncio.create_task(one(session, args.url, args.model, prompt, max_tokens)))
            if args.rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        for viewer in viewers:
            viewer.cancel()
        frames = [n for n in await asyncio.gather(*viewers, return_exceptions=True) if isinstance(n, int)]
    done = [r for r in results if r.ok]
    good = [r for r in done if r.ttft * 1e3 <= args.slo_ttft_ms and r.tpot * 1e3 <= args.slo_tpot_ms]
    return {
        "bench": "serve", "dataset": args.dataset, "rate": "inf" if args.rate == float("inf") else args.rate, "requests": len(results), "completed": len(done),
        "failed": len(results) - len(done), "errors": sorted({r.error for r in results if not r.ok})[:3],
        "duration_s": round(duration, 2), "request_throughput": round(len(done) / duration, 3),
        "output_tokens_per_s": round(sum(r.output_tokens for r in done) / duration, 1),
        "goodput": round(len(good) / duration, 3), "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "ttft": percentiles([r.ttft for r in done]), "tpot": percentiles([r.tpot for r in done]),
        "itl": percentiles([x for r in done for x in r.itl]), "e2e": percentiles([r.latency for r in done]),
        "dashboards": args.dashboard, "dashboard_worker_frames": sum(frames),
    }


async def watch_dashboard(session: aiohttp.ClientSession, url: str) -> int:
    """An open KV dashboard: reads /dashboard/events until cancelled; the worker snapshots it got."""
    frames = 0
    try:
        async with session.get(url + "/dashboard/events") as feed:
            async for line in feed.content:
                frames += line.startswith(b"event: worker")
    except asyncio.CancelledError:
        pass
    return frames


def print_table(res: dict) -> None:
    print(f"requests {res['completed']}/{res['requests']} in {res['duration_s']} s  |  {res['request_throughput']} req/s  |  "
          f"{res['output_tokens_per_s']} output tok/s  |  goodput {res['goodput']} req/s")
    print(f"{'metric':<8} {'p50 ms':>10} {'p90 ms':>10} {'p99 ms':>10}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        m = res[name]
        print(f"{name:<8} {m['p50_ms']!s:>10} {m['p90_ms']!s:>10} {m['p99_ms']!s:>10}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="gateway base URL (default: start a local stack)")
    ap.add_argument("--model", default=None, help="served model name (with --url) or model to start (without; "
                                                   "default: the random-weight demo model, as the figures use)")
    ap.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--rate", type=float, default=float("inf"), help="requests per second (inf: burst)")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dashboard", type=int, default=0, help="KV dashboards kept open during the run (their cost)")
    args = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.url is None:  # a throw-away redis-server + worker + gateway
            from pagedserve.stack import LocalStack

            local = stack.enter_context(LocalStack(model=args.model or "demo", workers=1))
            args.url, args.model = local.url, local.served_model_name
        res = asyncio.run(run(args))
    print(json.dumps(res))
    print_table(res)
    return 0 if res["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
