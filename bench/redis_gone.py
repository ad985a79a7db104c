"""Redis gone for good, under load: what the clients see, and how long a stop takes.

A local stack (embedded Redis, one worker, a gateway, the demo model) with ``--outage-grace`` and
``--drain-timeout`` as given. ``--requests`` greedy streams of ``--max-tokens`` each; once every
one has streamed, Redis is SIGKILLed and left down. Each stream ends ``errored`` (an error chunk:
the message is counted) or ``hung`` (nothing within ``--deadline``); a new request sent then is
timed to its answer (a 503). Then the stack is stopped (SIGTERM to the gateway and the worker,
Redis still down) and timed to the last child's exit, with each child's exit code; with
``--stop-after S``, S seconds after the kill, while the streams are still held (a SIGTERM inside
the grace: the streams end with the error at the stop).

Pass: every stream ended with the Redis error within the grace (or the stop) and 10 s, none hung,
the new request got a 503, and the stop took at most the drain timeout and 10 s with no child killed.

    python -m pagedserve.bench.redis_gone [--requests 20] [--max-tokens 1800] [--grace 30] [--drain 30] [--stop-after S]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import httpx

from pagedserve.bench.chaos import streams_started, tally
from pagedserve.bench.table import print_table
from pagedserve.stack import LocalStack

REDIS_ERROR = "unreachable"  # in the message of the error a held request ends with


async def under_load(stack: LocalStack, args: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=args.requests + 10)
    async with httpx.AsyncClient(base_url=stack.url, timeout=args.deadline + 10, limits=limits) as http:
        streams = await streams_started(http, stack.served_model_name, args.requests, args.max_tokens, args.deadline)
        stack.redis.proc.kill()  # SIGKILL, and it stays down
        killed = time.monotonic()
        await asyncio.sleep(1.0)
        asked = time.monotonic()
        fresh = await http.post("/v1/completions", json={"model": stack.served_model_name, "prompt": "x", "max_tokens": 4})
        fresh_s = time.monotonic() - asked
        stopped = {}
        if args.stop_after is not None:  # SIGTERM while the streams are held
            await asyncio.sleep(max(0.0, killed + args.stop_after - time.monotonic()))
            stopped = await asyncio.to_thread(timed_stop, stack)
        results = await asyncio.gather(*streams)
    ended = tally(results, results)
    return {**ended, **stopped, "redis_errors": sum(REDIS_ERROR in o.error for o in results),
            "last_end_after_kill_s": round(max(o.ended for o in results) - killed, 2),
            "new_request_status": fresh.status_code, "new_request_s": round(fresh_s, 2)}


def timed_stop(stack: LocalStack) -> dict:
    stopping = time.monotonic()
    stack.stop()
    return {"stop_s": round(time.monotonic() - stopping, 2)}


def run(args: argparse.Namespace) -> dict:
    grace = ("--outage-grace", str(args.grace))
    stack = LocalStack(model="demo", workers=1, extra_worker_args=grace, extra_gateway_args=grace,
                       drain_timeout_s=args.drain)
    with stack:
        result = asyncio.run(under_load(stack, args))
        if "stop_s" not in result:
            result.update(timed_stop(stack))  # Redis still down; the ``with`` finds nothing left to stop
    result["exit_codes"] = stack.exit_codes
    ends_by = args.grace if args.stop_after is None else min(args.grace, args.stop_after)
    checks = {"every stream ended with the Redis error": result["redis_errors"] == args.requests,
              "none hung": result["hung"] == 0,
              "within the grace (or the stop) and 10 s": result["last_end_after_kill_s"] <= ends_by + 10,
              "a new request is a 503": result["new_request_status"] == 503,
              "the stop within the drain timeout and 10 s": result["stop_s"] <= args.drain + 10,
              "no child killed": all(code >= 0 for code in stack.exit_codes.values())}
    return {"passed": all(checks.values()), "checks": checks, "requests": args.requests, "max_tokens": args.max_tokens,
            "grace_s": args.grace, "drain_s": args.drain, "stop_after_s": args.stop_after, **result}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=1800)
    ap.add_argument("--grace", type=float, default=30.0, help="--outage-grace of the gateway and the worker")
    ap.add_argument("--drain", type=float, default=30.0, help="--drain-timeout of the stack")
    ap.add_argument("--deadline", type=float, default=200.0, help="seconds before a stream counts as hung")
    ap.add_argument("--stop-after", type=float, default=None,
                    help="stop the stack this many seconds after the kill, with the streams held (default: after they end)")
    args = ap.parse_args(argv)
    os.environ.pop("REDIS_URL", None)  # the fault needs the embedded Redis
    result = run(args)
    print(json.dumps({"bench": "redis_gone", **result}))
    print_table([result], [(name, lambda r, k=key: r[k]) for name, key in (
        ("requests", "requests"), ("grace s", "grace_s"), ("stop after s", "stop_after_s"), ("errored", "errored"), ("hung", "hung"),
        ("last end after kill s", "last_end_after_kill_s"), ("new request", "new_request_status"),
        ("its answer s", "new_request_s"), ("stop s", "stop_s"), ("exit codes", "exit_codes"))])
    print(f"checks {result['checks']} -> {'PASS' if result['passed'] else 'FAIL'}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
