"""Partition, not kill: one worker loses Redis for ``--cut-s`` seconds without dying, under load.

A local stack (embedded Redis, one worker, a gateway, the demo model) plus a second worker whose
``--redis-url`` goes through a proxy that can cut the line (``bench/tcp_proxy.py``: while cut,
nothing arrives either way and nothing closes; at the heal, what was sent meanwhile arrives, as
TCP would deliver it, even for connections given up on). Greedy streams run twice: a clean pass
for the reference texts, then again with the cut once every stream has its first token.

While cut, the other worker takes the cut one's entries over (its liveness key expires after
three heartbeats): streams it had started resume from what their clients hold, the rest run
from the prompt. At the heal the cut worker's late writes reach Redis: events it sent into the
partition, and the backlog it had kept generating. The gateway takes, per request, only the
events of the entry's latest holder (``WireEvent.delivery``), and the cut worker, before sending
anything after the outage, asks which entries it still holds and drops the rest.

Pass: every stream completes with the reference text (nothing lost, repeated or mixed in), the
cut worker is alive and beating again afterwards (no restart, no hang), and it serves a request
of its own after the heal. Reported: the longest pause a stream saw, the events of a former
holder that reached the wire after a newer holder's (dropped by the gateway), and the events the
cut worker dropped itself.

    python -m pagedserve.bench.partition [--requests 24] [--cut-s 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import redis
import redis.asyncio as aioredis

from pagedserve.bench.chaos import held_by_worker, run_all, streams_started, tally
from pagedserve.bench.table import print_table
from pagedserve.bench.tcp_proxy import CuttableProxy
from pagedserve.shared.keys import Keys
from pagedserve.shared.protocol import decode_events
from pagedserve.stack import LocalStack

CUT = "cut-worker"
DROPPED_LINE = "requests taken over while this worker could not beat"


class WireTap:
    """Every event on the gateways' reply channels: per request, events that came from an older
    holder after a newer one had spoken (``late``)."""

    def __init__(self, url: str, keys: Keys) -> None:
        self.client = aioredis.from_url(url)
        self.pattern = keys.replies("*")
        self.newest: dict[str, int] = {}
        self.late = 0
        self.events = 0
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._pubsub = self.client.pubsub()
        await self._pubsub.psubscribe(self.pattern)
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            msg = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if msg is None:
                continue
            for event in decode_events(msg["data"]):
                self.events += 1
                if event.delivery < self.newest.get(event.id, 0):
                    self.late += 1
                self.newest[event.id] = max(self.newest.get(event.id, 0), event.delivery)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._pubsub.aclose()
        await self.client.aclose()


def start_cut_worker(stack: LocalStack, proxy_url: str, extra: tuple[str, ...]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedserve.cli", "worker", "--model", "demo", "--redis-url", proxy_url,
           "--served-model-name", stack.served_model_name, "--consumer", CUT, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    proc.log = []
    threading.Thread(target=lambda: proc.log.extend(proc.stderr), daemon=True).start()
    return proc


async def wait_beating(store: redis.Redis, keys: Keys, model: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if store.exists(keys.alive(model, CUT)):
            return True
        await asyncio.sleep(0.2)
    return False


async def run(stack: LocalStack, args: argparse.Namespace) -> dict:
    keys, model = Keys(), stack.served_model_name
    store = redis.Redis.from_url(stack.redis.url)
    host, port = stack.redis.url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    proxy = await CuttableProxy(host, int(port)).start()
    worker = start_cut_worker(stack, proxy.url, args.worker_args)
    tap = WireTap(stack.redis.url, keys)
    try:
        if not await wait_beating(store, keys, model, 300):
            raise RuntimeError("the worker behind the proxy did not come up")
        await tap.start()
        limits = httpx.Limits(max_connections=args.requests + 10)
        async with httpx.AsyncClient(base_url=stack.url, timeout=args.deadline + 10, limits=limits) as http:
            reference, _, _ = await run_all(http, stack, args.requests, args.max_tokens, args.deadline, None)
            streams = await streams_started(http, model, args.requests, args.max_tokens, args.deadline)
            held = held_by_worker(stack)
            proxy.cut()
            cut_at = time.monotonic()
            await asyncio.sleep(args.cut_s)
            proxy.heal()
            results = await asyncio.gather(*streams)
            back = await wait_beating(store, keys, model, 30) and worker.poll() is None
            served = await serves_after(http, store, keys, model)
        await asyncio.sleep(1.0)  # the last late events
    finally:
        await tap.stop()
        worker.terminate()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
        await proxy.close()
    ended = tally(results, reference)
    checks = {"every stream completed": ended["completed"] == args.requests, "no text differs": ended["corrupted"] == 0,
              "the cut worker held requests": held.get(CUT, 0) > 0, "the cut worker came back": back,
              "it serves after the heal": served}
    return {"passed": all(checks.values()), "checks": checks, "requests": args.requests, "cut_s": args.cut_s, **ended,
            "held_at_cut": held, "longest_pause_s": round(max(o.pause for o in results), 2),
            "last_end_after_cut_s": round(max(o.ended for o in results) - cut_at, 2),
            "late_events_on_the_wire": tap.late, "events_on_the_wire": tap.events,
            "dropped_by_the_cut_worker": sum(DROPPED_LINE in line for line in worker.log)}


async def serves_after(http: httpx.AsyncClient, store: redis.Redis, keys: Keys, model: str) -> bool:
    """Whether the cut worker answers a request after the heal: requests go out until one is held by
    it (its holder read while the request runs, every 10 ms: a fast machine answers within 0.3 s)."""
    stream, group = keys.requests(model), keys.group(model)
    for _ in range(40):
        body = {"model": model, "prompt": "again", "max_tokens": 64, "ignore_eos": True, "temperature": 0}
        sending = asyncio.create_task(http.post("/v1/completions", json=body))
        holders: set[str] = set()
        while not sending.done():
            holders |= {c["name"].decode() for c in (store.xpending(stream, group).get("consumers") or [])}
            await asyncio.sleep(0.01)
        r = await sending
        if CUT in holders and r.status_code == 200:
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--cut-s", type=float, default=30.0)
    ap.add_argument("--heartbeat", type=float, default=1.0, help="both workers' --heartbeat")
    ap.add_argument("--deadline", type=float, default=180.0, help="seconds before a request counts as hung")
    args = ap.parse_args(argv)
    args.worker_args = ("--heartbeat", str(args.heartbeat))
    os.environ.pop("REDIS_URL", None)  # the proxy stands in front of the embedded Redis
    with LocalStack(model="demo", workers=1, extra_worker_args=args.worker_args,
                    extra_gateway_args=("--routing", "shared")) as stack:
        result = asyncio.run(run(stack, args))
    print(json.dumps({"bench": "partition", **result}))
    print_table([result], [(name, lambda r, k=key: r[k]) for name, key in (
        ("requests", "requests"), ("cut s", "cut_s"), ("completed", "completed"), ("errored", "errored"),
        ("hung", "hung"), ("corrupt", "corrupted"), ("longest pause s", "longest_pause_s"),
        ("late events", "late_events_on_the_wire"), ("dropped by cut worker", "dropped_by_the_cut_worker"),
        ("held at cut", "held_at_cut"))])
    print(f"checks {result['checks']} -> {'PASS' if result['passed'] else 'FAIL'}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
