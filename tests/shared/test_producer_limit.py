"""The bounded enqueue (``runtime/producer.py``) on a real redis-server: a burst of requests
checked at once against ``--max-queue-depth`` lets exactly as many in as fit, counting the
model's shared stream and its workers' own (routed) streams, queued and running alike; a refused
request adds nothing."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.runtime.producer import Producer, QueueFull, QueueLimit
from pagedserve.runtime.redis_client import connect
from pagedserve.shared.keys import Keys
from pagedserve.shared.protocol import ReplyTarget, WireRequest
from pagedserve.shared.sampling import SamplingParams

KEYS = Keys()
MODEL = "m"


def request(rid: str) -> WireRequest:
    return WireRequest(id=rid, model=MODEL, params=SamplingParams(), reply=ReplyTarget("channel", KEYS.replies("t")),
                       prompt_token_ids=[1, 2])


def test_a_burst_checked_at_once_admits_exactly_what_fits(redis_server):
    shared, routed = KEYS.requests(MODEL), KEYS.routed(MODEL, "w1")
    limit = QueueLimit(10, (shared, routed))

    async def main():
        client = connect(redis_server.url)
        await client.delete(shared, routed)
        producer = Producer(client, KEYS)
        await client.xadd(routed, {"data": b"running on w1"})  # held by a worker: still counted
        results = await asyncio.gather(*(producer.enqueue([request(f"r{i}")], [routed if i % 3 else None], limit)
                                         for i in range(60)), return_exceptions=True)
        pairs = await asyncio.gather(*(producer.enqueue([request("a"), request("b")], (), limit) for _ in range(2)),
                                     return_exceptions=True)
        lengths = await client.xlen(shared) + await client.xlen(routed)
        await client.aclose()
        return results, pairs, lengths

    results, pairs, lengths = asyncio.run(main())
    admitted = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, QueueFull)]
    assert len(admitted) == 9 and len(refused) == 51 and lengths == 10
    assert all(r.limit == 10 and r.depth >= 9 for r in refused)
    assert all(isinstance(p, QueueFull) for p in pairs)  # two entries never half-added into a full queue


def test_a_request_routed_to_a_stream_not_counted_yet_is_counted(redis_server):
    """A worker that joined after the gateway listed them: its stream counts once a request goes there."""
    shared, other = KEYS.requests(MODEL), KEYS.routed(MODEL, "new-worker")

    async def main():
        client = connect(redis_server.url)
        await client.delete(shared, other)
        producer = Producer(client, KEYS)
        await client.xadd(other, {"data": b"queued there"})
        with pytest.raises(QueueFull) as full:
            await producer.enqueue([request("y")], [other], QueueLimit(1, (shared,)))
        lengths = await client.xlen(shared), await client.xlen(other)
        await client.aclose()
        return full.value.depth, lengths

    assert asyncio.run(main()) == (1, (0, 1))
