"""What the queue costs: the same workload through Redis (a worker process, a client) and in-process.

Reports output tokens/s and inter-token latency (p50/p90/p99, measured where the tokens arrive:
the client for Redis, the engine loop in-process), and the ratios. Uses ``REDIS_URL`` when set,
else starts a throw-away ``redis-server`` on a free port.

    python -m bench.queue_overhead [--requests 64] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagedserve.bench.stats import percentiles
from pagedserve.shared.keys import Keys
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.source.resolve import model_or_default

MODEL_NAME = "bench"
ENGINE_FLAGS = {"dtype": "float32", "num_gpu_blocks": 4096, "max_num_seqs": 128}


def workload(seed: int, count: int, max_tokens: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randint(10, 500) for _ in range(rng.randint(32, 128))], max_tokens) for _ in range(count)]


def in_process(model: Path, work) -> dict:
    from pagedserve.worker.engine import Engine
    from pagedserve.worker.setup.engine_config import EngineConfig

    engine = Engine(EngineConfig(model=str(model), **ENGINE_FLAGS))
    last: dict[str, float] = {}
    gaps: list[float] = []
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(work):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    tokens = 0
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            got = sum(len(o.new_token_ids) for o in out.outputs)
            if got:
                if out.request_id in last:
                    gaps.append(now - last[out.request_id])
                last[out.request_id] = now
                tokens += got
    seconds = time.perf_counter() - start
    return {"path": "in-process", "seconds": round(seconds, 2), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
            "itl": percentiles(gaps)}


async def through_redis(url: str, model: Path, work) -> dict:
    from pagedserve.runtime.client import QueueClient

    cmd = [sys.executable, "-m", "pagedserve.worker", "--model", str(model), "--redis-url", url, "--served-model-name", MODEL_NAME,
           "--consumer", "bench-worker", "--max-inflight", "128"]
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_FLAGS.items()]
    worker = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        async with QueueClient(url) as client:
            while not await client.redis.exists(Keys().alive(MODEL_NAME, "bench-worker")):
                await asyncio.sleep(0.1)
            gaps: list[float] = []

            async def run(prompt, n):
                stream = await client.submit(MODEL_NAME, prompt_token_ids=prompt,
                                             params=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
                last, count = None, 0
                async for event in stream:
                    now = time.perf_counter()
                    got = sum(len(o.token_ids) for o in event.outputs)
                    if got:
                        if last is not None:
                            gaps.append(now - last)
                        last, count = now, count + got
                return count

            start = time.perf_counter()
            counts = await asyncio.gather(*(run(p, n) for p, n in work))
            seconds = time.perf_counter() - start
    finally:
        worker.terminate()
        worker.wait(timeout=60)
    tokens = sum(counts)
    return {"path": "redis", "seconds": round(seconds, 2), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
            "itl": percentiles(gaps)}


async def transport_latency(url: str, rounds: int = 300) -> dict:
    """Redis alone: XADD -> XREADGROUP and PUBLISH -> receive, one message at a time."""
    import redis.asyncio as aioredis

    r = aioredis.from_url(url)
    stream, group = "bench:latency", "bench"
    await r.delete(stream)
    await r.xgroup_create(stream, group, id="0", mkstream=True)
    xadd: list[float] = []
    for _ in range(rounds):
        start = time.perf_counter()
        await r.xadd(stream, {"t": 1})
        await r.xreadgroup(group, "c", {stream: ">"}, count=1, block=1000)
        xadd.append(time.perf_counter() - start)
    pub: list[float] = []
    async with r.pubsub() as ps:
        await ps.subscribe("bench:latency")
        await ps.get_message(timeout=1)
        for _ in range(rounds):
            start = time.perf_counter()
            await r.publish("bench:latency", b"x")
            while await ps.get_message(ignore_subscribe_messages=True, timeout=1) is None:
                pass
            pub.append(time.perf_counter() - start)
    await r.delete(stream)
    await r.aclose()
    return {"xadd_to_xreadgroup": percentiles(xadd), "publish_to_receive": percentiles(pub)}


def redis_url_or_start(stack) -> str:
    from pagedserve.embedded_redis import RedisServer
    from pagedserve.runtime.env import redis_url_from_env

    url = redis_url_from_env()
    if url:
        return url

    server = RedisServer(Path(stack.enter_context(tempfile.TemporaryDirectory()))).start()
    stack.callback(server.stop)
    return server.url


def main(argv: list[str] | None = None) -> int:
    import contextlib

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="demo", help="model directory or GGUF file (default: the random-weight demo model)")
    args = ap.parse_args(argv)
    model = model_or_default(args.model)
    work = workload(args.seed, args.requests, args.max_tokens)
    with contextlib.ExitStack() as stack:
        url = redis_url_or_start(stack)
        local = in_process(model, work)
        queued = asyncio.run(through_redis(url, model, work))
        transport = asyncio.run(transport_latency(url))
    result = {"bench": "queue_overhead", "requests": args.requests, "max_tokens": args.max_tokens, "results": [local, queued],
              "transport": transport,
              "throughput_ratio": round(queued["tokens_per_s"] / local["tokens_per_s"], 3),
              "added_p50_itl_ms": round(queued["itl"]["p50_ms"] - local["itl"]["p50_ms"], 3)}
    print(json.dumps(result))
    print(f"{'path':<12} {'seconds':>8} {'tokens':>7} {'tok/s':>8} {'ITL p50 ms':>11} {'p90':>8} {'p99':>8}")
    for r in (local, queued):
        print(f"{r['path']:<12} {r['seconds']:>8} {r['tokens']:>7} {r['tokens_per_s']:>8} {r['itl']['p50_ms']:>11} "
              f"{r['itl']['p90_ms']:>8} {r['itl']['p99_ms']:>8}")
    print(f"through Redis: {result['throughput_ratio']:.1%} of in-process throughput, "
          f"{result['added_p50_itl_ms']:+.3f} ms p50 inter-token latency")
    print(f"Redis alone, p50: XADD->XREADGROUP {transport['xadd_to_xreadgroup']['p50_ms']} ms, "
          f"PUBLISH->receive {transport['publish_to_receive']['p50_ms']} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
