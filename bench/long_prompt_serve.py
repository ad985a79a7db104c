"""A long prompt beside streams, through an OpenAI-compatible server (issue #64's scenario as a user
of a shared server meets it): ``--streams`` clients stream completions (``--output`` tokens, greedy,
EOS ignored); ``--warm`` seconds in, another sends a fresh prompt of about ``--prompt-words`` words
(``max_tokens`` 1). Measured: the long prompt's time to its first token, the streams' gaps between
chunks before it came (p50) and while it prefilled (p50, p99, and the longest: the pause every stream
sees); then, alone, the same long prompt again (another one of its length: no prefix hit) for its TTFT
without streams. Any server: pagedserve's gateway, vLLM's, llama.cpp's ``llama-server`` (``-np`` one
slot more than the streams); prompts are text, so each server's tokenizer counts them (the JSON says
the prompt tokens the server reported).

    python -m pagedserve.bench.long_prompt_serve --url http://127.0.0.1:8000 --model NAME [--label pagedserve]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import httpx

from pagedserve.bench.stats import percentiles
from pagedserve.bench.table import print_table

TEXT = Path(__file__).with_name("texts") / "declaration.txt"


def long_text(words: int, seed: int) -> str:
    """About ``words`` words of prose, shuffled by ``seed`` (two seeds share no long prefix)."""
    source = TEXT.read_text().split()
    rng = random.Random(seed)
    return " ".join(rng.choice(source) for _ in range(words))


async def stream(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, times: list[float],
                 usage: dict) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage.update(chunk["usage"])
            if any(c.get("text") for c in chunk.get("choices") or []):
                times.append(time.perf_counter())


async def scenario(args: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=args.streams + 4)
    async with httpx.AsyncClient(base_url=args.url, timeout=600, limits=limits) as http:
        stamps = [[] for _ in range(args.streams)]
        streams = [asyncio.create_task(stream(http, args.model, f"Story {i}: " + long_text(40, 100 + i), args.output,
                                              stamps[i], {})) for i in range(args.streams)]
        await asyncio.sleep(args.warm)
        failed = [task.exception() for task in streams if task.done() and task.exception() is not None]
        if failed or not all(stamps):  # a server not ready (or refusing) would give figures of nothing
            for task in streams:
                task.cancel()
            why = repr(failed[0]) if failed else "no token yet"
            raise SystemExit(f"the streams did not all start within --warm {args.warm:g} s: {why}")
        long_times, long_usage = [], {}
        sent = time.perf_counter()
        await stream(http, args.model, long_text(args.prompt_words, 1), 1, long_times, long_usage)
        first = long_times[0] if long_times else time.perf_counter()
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        before = [b - a for s in stamps for a, b in zip(s, s[1:]) if b < sent]
        during = [b - a for s in stamps for a, b in zip(s, s[1:]) if b >= sent and a <= first]
    # alone, on a new connection: llama-server closed a pooled one as it was reused (a keep-alive race)
    async with httpx.AsyncClient(base_url=args.url, timeout=600) as http:
        alone_times, alone_usage = [], {}
        alone_sent = time.perf_counter()
        await stream(http, args.model, long_text(args.prompt_words, 2), 1, alone_times, alone_usage)
        alone = (alone_times[0] if alone_times else time.perf_counter()) - alone_sent
    return {"bench": "long_prompt_serve", "label": args.label, "streams": args.streams,
            "prompt_tokens": long_usage.get("prompt_tokens"), "ttft_s": round(first - sent, 2),
            "itl_before": percentiles(before), "itl_during": percentiles(during),
            "longest_gap_s": round(max(during, default=0.0), 3), "alone_ttft_s": round(alone, 2),
            "alone_prompt_tokens": alone_usage.get("prompt_tokens")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the model name the server answers to")
    parser.add_argument("--label", default="server")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--output", type=int, default=1200)
    parser.add_argument("--prompt-words", type=int, default=6000, help="about 7,300 tokens with SmolLM2's tokenizer")
    parser.add_argument("--warm", type=float, default=3.0)
    args = parser.parse_args()
    result = asyncio.run(scenario(args))
    print(json.dumps(result))
    print_table([result], [("server", lambda r: r["label"]), ("prompt tok", lambda r: r["prompt_tokens"]),
                           ("TTFT s", lambda r: r["ttft_s"]), ("ITL p50 before ms", lambda r: r["itl_before"]["p50_ms"]),
                           ("gap p50 during ms", lambda r: r["itl_during"]["p50_ms"]),
                           ("gap p99 during ms", lambda r: r["itl_during"]["p99_ms"]),
                           ("longest gap s", lambda r: r["longest_gap_s"]), ("alone TTFT s", lambda r: r["alone_ttft_s"])])


if __name__ == "__main__":
    main()
