"""``worker/serve/outbox.py`` on its own, on a real redis-server with no engine and no gateway: batches
sent in order until ``close``, a reply target Redis refuses stopping its own requests only, nothing
sent for an entry let go of (even what was queued before), and, once the liveness key may have
expired, the entries another worker took over meanwhile found, dropped and stopped before anything
is sent."""

from __future__ import annotations

import asyncio

from structlog.testing import capture_logs

from pagedserve.runtime.redis_client import connect
from pagedserve.shared.keys import Keys
from pagedserve.shared.protocol import ReplyTarget, WireEvent, WireRequest, decode_events
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.serve.bridge import Outgoing, RedisBridge
from pagedserve.worker.serve.events import InFlight
from pagedserve.worker.serve.inflight import InFlightTable
from pagedserve.worker.serve.outbox import Outbox

KEYS = Keys()
TTL_S = 30.0


class Retrying:
    """The service's retry wrapper, as the outbox calls it: what it sends, under which name (the
    name is what the service's log and its Redis-outage counter say)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    async def __call__(self, name: str, send):
        self.names.append(name)
        return await send()


def run(url: str, test):
    """``test(redis, w1, w2, held)``: two workers' bridges on one model; ``held`` the entry ids w1 read."""
    async def main():
        redis = connect(url)
        try:
            w1, w2 = (RedisBridge(redis, KEYS, "m", name) for name in ("w1", "w2"))
            await w1.ensure_group()
            for data in (b"a", b"b", b"c"):
                await redis.xadd(w1.stream, {"data": data})
            held = [entry.entry_id for entry in await w1.read(3, None)]
            return await test(redis, w1, w2, held)
        finally:
            await redis.aclose()
    return asyncio.run(main())


def requests(entries: list[str], target: str = "out") -> InFlightTable:
    """Requests a, b, c on entries ``entries``, each answered on the stream ``target:<id>``."""
    table = InFlightTable(8, 8, str)
    for request_id, entry in zip("abc", entries):
        request = WireRequest(id=request_id, model="m", params=SamplingParams(max_tokens=4),
                              reply=ReplyTarget("stream", f"{target}:{request_id}"), prompt_token_ids=[1])
        table.add(InFlight(entry, request))
    return table


def event(table: InFlightTable, request_id: str, seq: int, done: bool = False) -> Outgoing:
    flight = table.get(request_id)
    return Outgoing(flight.request.reply, WireEvent(request_id, seq, done=done), flight.entry_id)


async def received(redis, stream: str) -> list[tuple[str, int, bool]]:
    return [(e.id, e.seq, e.done) for _, fields in await redis.xrange(stream) for e in decode_events(fields[b"data"])]


def test_batches_go_in_order_until_close_and_the_end_acknowledges_the_entry(redis_server):
    async def test(redis, w1, w2, held):
        table = requests(held)
        outbox = Outbox(w1, table, lambda request_id: None, TTL_S)
        outbox.put([event(table, "a", 0), event(table, "b", 0)])
        outbox.put([event(table, "a", 1, done=True)])
        outbox.close()
        outbox.put([event(table, "b", 1)])  # after close: never sent
        retrying = Retrying()
        await asyncio.wait_for(outbox.run(retrying), 10)
        assert retrying.names == ["publish", "publish"]
        assert await received(redis, "out:a") == [("a", 0, False), ("a", 1, True)]
        assert await received(redis, "out:b") == [("b", 0, False)]
        pending = await redis.xpending_range(w1.stream, w1.group, "-", "+", 10)
        assert sorted(p["message_id"].decode() for p in pending) == sorted(held[1:])  # a's entry acknowledged

    run(redis_server.url, test)


def test_a_refused_reply_target_stops_its_own_requests_only(redis_server):
    async def test(redis, w1, w2, held):
        table = requests(held)
        await redis.set("out:b", "a string, not a stream")  # XADD to it fails
        stopped = []
        outbox = Outbox(w1, table, stopped.append, TTL_S)
        outbox.put([event(table, "a", 0), event(table, "b", 0), event(table, "c", 0)])
        outbox.close()
        with capture_logs() as logs:
            await asyncio.wait_for(outbox.run(Retrying()), 10)
        assert stopped == ["b"]
        assert await received(redis, "out:a") == [("a", 0, False)] and await received(redis, "out:c") == [("c", 0, False)]
        refused = [line for line in logs if line["event"].startswith("reply target refused")]
        assert [(line["target"], line["requests"]) for line in refused] == [("out:b", ["b"])]
        assert "WRONGTYPE" in refused[0]["error"]  # Redis's own words, for the operator

    run(redis_server.url, test)


def test_nothing_is_sent_for_an_entry_let_go_of_even_what_was_queued_before(redis_server):
    async def test(redis, w1, w2, held):
        table = requests(held)
        stopped = []
        outbox = Outbox(w1, table, stopped.append, TTL_S)
        outbox.put([event(table, "a", 0), event(table, "b", 0), event(table, "c", 0)])
        outbox.let_go({held[0]})
        outbox.let_go({held[2]})  # a second entry lost before the first's events went: both stay dropped
        outbox.put([event(table, "a", 1), event(table, "b", 1)])
        outbox.close()
        await asyncio.wait_for(outbox.run(Retrying()), 10)
        assert stopped == ["a", "c"]
        assert await received(redis, "out:a") == [] and await received(redis, "out:c") == []
        assert await received(redis, "out:b") == [("b", 0, False), ("b", 1, False)]
        assert table.beating() == [held[1]]  # no heartbeat for them either

    run(redis_server.url, test)


def test_after_a_silence_past_the_ttl_entries_taken_over_meanwhile_are_dropped_before_anything_is_sent(redis_server):
    async def test(redis, w1, w2, held):
        table = requests(held)
        stopped = []
        outbox = Outbox(w1, table, stopped.append, ttl_s=0.2)
        await redis.xclaim(w1.stream, w1.group, "w2", 0, [held[1]])  # w2 took b over while w1 was silent
        await asyncio.sleep(0.3)
        outbox.put([event(table, "a", 0), event(table, "b", 0)])
        outbox.close()
        with capture_logs() as logs:
            await asyncio.wait_for(outbox.run(Retrying()), 10)
        assert stopped == ["b"]
        assert await received(redis, "out:a") == [("a", 0, False)] and await received(redis, "out:b") == []
        assert [line["entries"] for line in logs if line["event"].startswith("requests taken over")] == [[held[1]]]
        assert await redis.get(KEYS.alive("m", "w1")) == w1.token.encode()  # the liveness key renewed with the check
        # The check counts as a heartbeat: within the ttl after it the next batch goes without another
        # check (a's entry taken over since is not looked at, and its event goes).
        await redis.xclaim(w1.stream, w1.group, "w2", 0, [held[0]])
        outbox.put([event(table, "a", 1)])
        outbox.close()
        await asyncio.wait_for(outbox.run(Retrying()), 10)
        assert await received(redis, "out:a") == [("a", 0, False), ("a", 1, False)]

    run(redis_server.url, test)
