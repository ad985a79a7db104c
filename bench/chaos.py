"""Chaos benchmark: what clients see when a worker is SIGKILLed, or Redis restarts, under load.

Starts a local stack (embedded Redis, ``--workers`` workers, a gateway, the demo model) and runs
two faults, each under ``--requests`` concurrent streaming completions:

- ``worker-kill``: once every stream has its first token, the worker holding the most requests
  gets SIGKILL (``pagedserve up``'s supervision is not used here: the peer takes over);
- ``redis-restart``: Redis is stopped and started empty while the streams run.

Each request (greedy) runs twice, first with no fault for the reference text, and ends as
``completed`` (finish_reason length, all its tokens, the reference text), ``errored`` (an error
event or an HTTP error; the messages are counted), ``hung`` (no end within ``--deadline``
seconds), ``duplicated`` (more tokens than asked for) or ``corrupted`` (the streamed text differs
from the reference: tokens lost, repeated or changed). Also reported: how many requests each worker held when the fault came, and
the time from the fault to the last request's end. Prints a JSON line and a table.

    python -m bench.chaos [--requests 40] [--workers 2] [--max-tokens 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import httpx
import redis

from pagedserve.bench.table import print_table
from pagedserve.shared.keys import Keys
from pagedserve.stack import LocalStack


@dataclass
class Progress:
    """Which requests have streamed a token; ``all_started`` is set once every one has."""

    needed: int
    started: set[int] = field(default_factory=set)
    all_started: asyncio.Event = field(default_factory=asyncio.Event)

    def saw(self, i: int) -> None:
        self.started.add(i)
        if len(self.started) == self.needed:
            self.all_started.set()


@dataclass
class Outcome:
    kind: str  # completed | errored | hung | duplicated | corrupted
    ended: float  # monotonic time the request ended
    text: str = ""
    error: str = ""
    pause: float = 0.0  # the longest wait between two chunks: what a fault cost this stream


async def one(http: httpx.AsyncClient, model: str, max_tokens: int, i: int, progress: Progress,
              deadline: float) -> Outcome:
    body = {"model": model, "prompt": [20 + i % 200, 21, 22], "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    tokens, text, last, pause = 0, [], time.monotonic(), 0.0
    try:
        async with asyncio.timeout(deadline):
            async with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return Outcome("errored", time.monotonic(), error=f"HTTP {r.status_code}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return Outcome("errored", time.monotonic(), error=chunk["error"].get("message", ""))
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    elif chunk["choices"]:
                        text.append(chunk["choices"][0].get("text") or "")
                        if i in progress.started:
                            pause = max(pause, time.monotonic() - last)
                        last = time.monotonic()
                        progress.saw(i)
        kind = "completed" if tokens == max_tokens else ("duplicated" if tokens > max_tokens else "errored")
        return Outcome(kind, time.monotonic(), "".join(text), "" if kind == "completed" else f"{tokens} tokens", pause)
    except (TimeoutError, asyncio.TimeoutError):
        return Outcome("hung", time.monotonic())
    except httpx.HTTPError as err:
        return Outcome("errored", time.monotonic(), error=type(err).__name__)


async def run_all(http, stack: LocalStack, requests: int, max_tokens: int, deadline: float, fault: str | None) -> tuple:
    """Every request at once; with ``fault``, injected once each has streamed. (outcomes, held, fault time)."""
    progress = Progress(requests)
    tasks = [asyncio.create_task(one(http, stack.served_model_name, max_tokens, i, progress, deadline))
             for i in range(requests)]
    held, fault_at = {}, time.monotonic()
    if fault is not None:
        try:
            await asyncio.wait_for(progress.all_started.wait(), 120)
        except asyncio.TimeoutError:
            pass
        held = held_by_worker(stack)
        fault_at = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, inject, stack, fault, held)
    return await asyncio.gather(*tasks), held, fault_at


async def streams_started(http, model: str, requests: int, max_tokens: int, deadline: float) -> list[asyncio.Task]:
    """``requests`` greedy streams (``one``), returned once each has streamed (or after 120 s)."""
    progress = Progress(requests)
    streams = [asyncio.create_task(one(http, model, max_tokens, i, progress, deadline)) for i in range(requests)]
    try:
        await asyncio.wait_for(progress.all_started.wait(), 120)
    except asyncio.TimeoutError:
        pass
    return streams


def tally(results: list[Outcome], reference: list[Outcome]) -> dict:
    """How the streams ended (a completed one whose text is not the clean pass's is ``corrupted``)
    and each error message with its count."""
    for got, want in zip(results, reference):
        if got.kind == "completed" and want.kind == "completed" and got.text != want.text:
            got.kind, got.error = "corrupted", "text differs from the clean pass"
    counts = {k: sum(1 for o in results if o.kind == k) for k in ("completed", "errored", "hung", "duplicated", "corrupted")}
    errors: dict[str, int] = {}
    for o in results:
        if o.error:
            errors[o.error] = errors.get(o.error, 0) + 1
    return {**counts, "errors": errors}


async def run_fault(stack: LocalStack, fault: str, requests: int, max_tokens: int, deadline: float) -> dict:
    """A clean pass for the reference texts (greedy), then the same requests with the fault."""
    limits = httpx.Limits(max_connections=requests + 10)
    async with httpx.AsyncClient(base_url=stack.url, timeout=deadline + 10, limits=limits) as http:
        clean_at = time.monotonic()
        reference, _, _ = await run_all(http, stack, requests, max_tokens, deadline, None)
        clean_s = time.monotonic() - clean_at
        results, held, fault_at = await run_all(http, stack, requests, max_tokens, deadline, fault)
    return {"fault": fault, "requests": requests, "held_by_worker": held, **tally(results, reference),
            "last_end_s": round(max(o.ended for o in results) - fault_at, 2), "clean_pass_s": round(clean_s, 2),
            "longest_pause_s": round(max(o.pause for o in results), 2)}


FAULTS = ("worker-kill", "redis-restart")


def held_by_worker(stack: LocalStack) -> dict[str, int]:
    """Unacknowledged entries per worker (consumer name) when the fault comes."""
    client = redis.Redis.from_url(stack.redis.url)
    keys = Keys()
    try:
        summary = client.xpending(keys.requests(stack.served_model_name), keys.group(stack.served_model_name))
    finally:
        client.close()
    return {c["name"].decode(): int(c["pending"]) for c in summary.get("consumers") or []}


def inject(stack: LocalStack, fault: str, held: dict[str, int]) -> None:
    if fault == "worker-kill":  # the worker holding the most requests
        victim = max(held, key=held.get) if held else None
        for child in stack.children:
            args = list(child.args)
            if "worker" in args and (victim is None or args[args.index("--consumer") + 1] == victim):
                os.kill(child.pid, signal.SIGKILL)
                return
    else:
        stack.redis.stop()
        time.sleep(1.0)
        stack.redis.start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--deadline", type=float, default=90.0, help="seconds before a request counts as hung")
    ap.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    args = ap.parse_args(argv)
    os.environ.pop("REDIS_URL", None)  # the fault needs the embedded Redis
    rows = []
    for fault in args.faults:
        with LocalStack(model="demo", workers=args.workers) as stack:
            rows.append(asyncio.run(run_fault(stack, fault, args.requests, args.max_tokens, args.deadline)))
    print(json.dumps({"bench": "chaos", "workers": args.workers, "max_tokens": args.max_tokens, "results": rows}))
    print_table(rows, [(name, lambda r, k=key: r[k]) for name, key in (
        ("fault", "fault"), ("requests", "requests"), ("completed", "completed"), ("errored", "errored"),
        ("hung", "hung"), ("dup", "duplicated"), ("corrupt", "corrupted"), ("longest pause s", "longest_pause_s"),
        ("last end s", "last_end_s"), ("clean pass s", "clean_pass_s"),
        ("held by worker", "held_by_worker"))])
    for row in rows:
        for message, count in row["errors"].items():
            print(f"  {row['fault']}: {count} x {message}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
