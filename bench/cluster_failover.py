"""Redis Cluster failover under load: three masters with a replica each, two workers and a gateway
on it (the demo model). Greedy streams run twice: a clean pass for the reference texts, then again
with the master that holds the model's slot (every key of a model shares one hash tag) SIGKILLed
once every stream has its first token. Its replica takes over after the cluster's node timeout (2 s).

Reported, as a client sees it: streams completed, errored (with each message and its count), hung
or corrupted (text not the clean pass's); the longest pause a stream saw; how long the cluster took
to serve the slot again (from the kill to the first node naming the replica its owner); the time
from the kill to the last stream's end; and whether both workers and the gateway are still up.
Replication is asynchronous: what the master took in its last moments may be gone, and those
requests are sent again by the gateway (their entry vanished).

    python -m pagedserve.bench.cluster_failover [--requests 24] [--max-tokens 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis
from redis.crc import key_slot

from pagedserve.bench.chaos import run_all, streams_started, tally
from pagedserve.bench.table import print_table
from pagedserve.embedded_redis import RedisClusterServers
from pagedserve.shared.keys import Keys
from pagedserve.stack import LocalStack


def slot_owner(port: int, slot: int) -> int | None:
    """The port of the node that ``port``'s node says serves ``slot`` (None when it cannot say)."""
    try:
        client = redis.Redis(port=port, socket_timeout=1)
        for start, end, owner, *_ in client.execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return int(owner[1])
    except redis.RedisError:
        return None
    finally:
        client.close()
    return None


async def taken_over(cluster: RedisClusterServers, killed: int, slot: int, timeout: float = 60.0) -> float | None:
    """Seconds until a surviving node names another owner for ``slot``; None if none did in time."""
    started = time.monotonic()
    survivors = [n.port for n in cluster.nodes if n.port != killed]
    while time.monotonic() - started < timeout:
        owners = {slot_owner(port, slot) for port in survivors}
        if any(owner not in (None, killed) for owner in owners):
            return time.monotonic() - started
        await asyncio.sleep(0.1)
    return None


async def run(stack: LocalStack, cluster: RedisClusterServers, args: argparse.Namespace) -> dict:
    model = stack.served_model_name
    slot = key_slot(Keys().requests(model).encode())
    master = slot_owner(cluster.nodes[0].port, slot)
    victim = next(n for n in cluster.nodes if n.port == master)
    limits = httpx.Limits(max_connections=args.requests + 10)
    async with httpx.AsyncClient(base_url=stack.url, timeout=args.deadline + 10, limits=limits) as http:
        reference, _, _ = await run_all(http, stack, args.requests, args.max_tokens, args.deadline, None)
        streams = await streams_started(http, model, args.requests, args.max_tokens, args.deadline)
        victim.proc.kill()
        killed_at = time.monotonic()
        failover_s = await taken_over(cluster, master, slot)
        results = await asyncio.gather(*streams)
    up = {child.args[3] + f"-{i}": child.poll() is None for i, child in enumerate(stack.children)}
    return {"requests": args.requests, **tally(results, reference),
            "failover_s": None if failover_s is None else round(failover_s, 2),
            "longest_pause_s": round(max(o.pause for o in results), 2),
            "last_end_after_kill_s": round(max(o.ended for o in results) - killed_at, 2), "processes_up": up}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--deadline", type=float, default=180.0, help="seconds before a request counts as hung")
    ap.add_argument("--heartbeat", type=float, default=1.0, help="the workers' --heartbeat (liveness: three of them)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pagedserve-cluster-") as tmp:
        cluster = RedisClusterServers(Path(tmp), masters=3, replicas=1).start()
        try:
            with LocalStack(model="demo", workers=2, redis_url=cluster.url,
                            extra_worker_args=("--heartbeat", str(args.heartbeat))) as stack:
                result = asyncio.run(run(stack, cluster, args))
        finally:
            cluster.stop()
    result["passed"] = (result["completed"] == args.requests and result["corrupted"] == 0
                        and all(result["processes_up"].values()))
    print(json.dumps({"bench": "cluster_failover", "heartbeat": args.heartbeat, **result}))
    print_table([result], [(name, lambda r, k=key: r[k]) for name, key in (
        ("requests", "requests"), ("completed", "completed"), ("errored", "errored"), ("hung", "hung"),
        ("corrupt", "corrupted"), ("failover s", "failover_s"), ("longest pause s", "longest_pause_s"),
        ("last end s", "last_end_after_kill_s"))])
    for message, count in result["errors"].items():
        print(f"  {count} x {message}")
    print(f"processes up after: {result['processes_up']}  -> {'PASS' if result['passed'] else 'FAIL'}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
