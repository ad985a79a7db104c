"""``worker/serve/bridge.py`` on its own: a worker's Redis I/O against a real redis-server, with no
engine and no gateway. Reading (its own stream first, ``r:`` ids, never past ``count``: the
shared entries it has no room for stay where they are, with their ids), acknowledging on the stream an id names, taking a consumer name, reclaiming from the
idle and the dead, adopting a dead worker's own stream, heartbeats that keep only what is still
held, publishing batches per reply target (a refused target failing only its own), handing back,
dead letters, leaving."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.runtime.redis_client import connect
from pagedserve.shared.keys import Keys
from pagedserve.shared.protocol import ReplyTarget, WireEvent, decode_events
from pagedserve.worker.serve import bridge as bridge_module
from pagedserve.worker.serve.bridge import OWN, ConsumerNameTaken, Entry, Outgoing, RedisBridge

MODEL = "m"
KEYS = Keys()


def run(url: str, test):
    """``test(redis, w1, w2)``: two workers' bridges on one model, their groups made."""
    async def main():
        redis = connect(url)
        try:
            bridges = [RedisBridge(redis, KEYS, MODEL, name) for name in ("w1", "w2")]
            for bridge in bridges:
                await bridge.ensure_group()
            return await test(redis, *bridges)
        finally:
            await redis.aclose()
    return asyncio.run(main())


async def add(redis, stream: str, *payloads: bytes) -> list[str]:
    return [(await redis.xadd(stream, {"data": p})).decode() for p in payloads]


async def pending_of(redis, stream: str, **consumer) -> dict[str, int]:
    """id -> times delivered, of every pending entry of the model's group on ``stream`` (``consumername=``: its only)."""
    held = await redis.xpending_range(stream, KEYS.group(MODEL), "-", "+", 100, **consumer)
    return {e["message_id"].decode(): e["times_delivered"] for e in held}


async def datas(redis, stream: str) -> list[bytes]:
    return [fields[b"data"] for _, fields in await redis.xrange(stream)]


def test_a_worker_reads_its_own_stream_first_and_leaves_the_shared_entries_past_its_count(redis_server):
    async def test(redis, w1, w2):
        shared = await add(redis, w1.stream, b"s1", b"s2", b"s3")
        own = await add(redis, w1.own, b"o1", b"o2")
        assert [e.data for e in await w1.read(1, None)] == [b"o1"]  # the count holds with the own stream alone
        entries = await w1.read(2, None)
        assert [(e.entry_id.startswith(OWN), e.data, e.deliveries) for e in entries] == [(True, b"o2", 1), (False, b"s1", 1)]
        assert entries[0].entry_id == OWN + own[1]
        # s2 and s3 were never read: w2 gets them, in order, under the ids their sender knows
        # (an entry added again would get a new id, and its gateway would send the request twice)
        assert [(e.entry_id, e.data) for e in await w2.read(10, None)] == [(shared[1], b"s2"), (shared[2], b"s3")]
        assert list(await pending_of(redis, w1.stream, consumername="w1")) == [entries[1].entry_id]
        # what w1 holds, read again (after a restart): its own and the shared one
        held = await w1.read(100, None, own_pending=True)
        assert sorted(e.data for e in held) == [b"o1", b"o2", b"s1"]
        assert await w1.read(5, 50) == []  # nothing new: the block ends empty
        await redis.xdel(w1.stream, entries[1].entry_id)  # deleted while held: read back without its data
        held = await w1.read(1, None, own_pending=True)
        assert Entry(entries[1].entry_id, None) in held

    run(redis_server.url, test)


def test_requests_queued_before_the_first_worker_came_are_read_and_a_read_waits_for_new_ones(redis_server):
    async def test(redis, w1, _):
        early = RedisBridge(redis, KEYS, "early", "w1")
        await add(redis, early.stream, b"queued first")
        await early.ensure_group()
        assert [e.data for e in await early.read(5, None)] == [b"queued first"]

        async def later():
            await asyncio.sleep(0.2)
            await add(redis, w1.stream, b"later")

        adding = asyncio.create_task(later())
        assert [e.data for e in await w1.read(5, 5000)] == [b"later"]
        await adding

    run(redis_server.url, test)


def test_acks_go_to_the_stream_each_id_names_and_delete_the_entry(redis_server):
    async def test(redis, w1, w2):
        await add(redis, w1.stream, b"s")
        await add(redis, w1.own, b"o")
        entries = await w1.read(5, None)
        await w1.ack([e.entry_id for e in entries])
        await w1.ack([])
        for stream in (w1.stream, w1.own):
            assert await redis.xlen(stream) == 0 and await pending_of(redis, stream) == {}

    run(redis_server.url, test)


def test_groups_are_made_once_and_a_stream_key_of_another_type_is_an_error(redis_server):
    async def test(redis, w1, w2):
        await w1.ensure_group()  # again: BUSYGROUP is fine
        assert [g["name"] for g in await redis.xinfo_groups(w1.own)] == [KEYS.group(MODEL).encode()]
        await redis.set(KEYS.requests("other"), b"not a stream")
        with pytest.raises(Exception, match="WRONGTYPE|key"):
            await RedisBridge(redis, KEYS, "other", "w1").ensure_group()

    run(redis_server.url, test)


def test_a_consumer_name_is_taken_once_with_its_info_until_its_key_expires(redis_server):
    async def test(redis, w1, _):
        await w1.wait_for_name(0.6, 0, b"info-1")
        assert await redis.get(KEYS.alive(MODEL, "w1")) == w1.token.encode()
        assert await redis.get(KEYS.worker_info(MODEL, "w1")) == b"info-1"
        assert 0 < await redis.pttl(KEYS.worker_info(MODEL, "w1")) <= 600
        await w1.wait_for_name(10, 0, b"info-2")  # its own name again: the info renewed with the new expiry
        assert await redis.get(KEYS.worker_info(MODEL, "w1")) == b"info-2"
        assert 9000 < await redis.pttl(KEYS.worker_info(MODEL, "w1")) <= 10_000
        twin = RedisBridge(redis, KEYS, MODEL, "w1")
        assert twin.token != w1.token
        with pytest.raises(ConsumerNameTaken) as taken:
            await twin.wait_for_name(0.6, 0.1, b"twin")
        assert str(taken.value) == "another live worker uses the consumer name 'w1'; give this one a different --consumer"
        assert await redis.get(KEYS.worker_info(MODEL, "w1")) == b"info-2"
        await twin.wait_for_name(0.6, 5, b"twin")  # w1 stopped beating: its key expires, the name is free
        assert await redis.get(KEYS.alive(MODEL, "w1")) == twin.token.encode()

    run(redis_server.url, test)


def test_idle_entries_are_reclaimed_with_their_deliveries_and_deleted_ones_acknowledged(redis_server):
    async def test(redis, w1, w2):
        ids = await add(redis, w1.stream, b"a", b"b", b"c")
        await w1.read(3, None)
        await redis.xdel(w1.stream, ids[1])  # gone while held
        await asyncio.sleep(0.05)
        assert await w2.reclaim(10_000, 10) == []  # not idle long enough
        first = await w2.reclaim(10, 1)  # up to the count
        assert [(e.entry_id, e.data, e.deliveries) for e in first] == [(ids[0], b"a", 2)]
        claimed = await w2.reclaim(10, 10)
        assert [(e.entry_id, e.data, e.deliveries) for e in claimed] == [(ids[2], b"c", 2)]
        assert await pending_of(redis, w1.stream) == {ids[0]: 2, ids[2]: 2}  # the deleted one acknowledged

    run(redis_server.url, test)


def test_entries_of_a_consumer_that_stopped_beating_are_claimed_up_to_the_count(redis_server):
    async def test(redis, w1, w2):
        ids = await add(redis, w1.stream, b"a", b"b", b"c")
        await w1.read(3, None)
        await redis.set(KEYS.alive(MODEL, "w1"), b"x")
        assert await w2.reclaim_from_dead(10) == []  # alive: left alone
        await redis.delete(KEYS.alive(MODEL, "w1"))
        assert await w1.reclaim_from_dead(10) == []  # its own entries are not "from the dead"
        claimed = await w2.reclaim_from_dead(2)
        assert [(e.entry_id, e.data, e.deliveries) for e in claimed] == [(ids[0], b"a", 2), (ids[1], b"b", 2)]
        rest = await w2.reclaim_from_dead(5)
        assert [e.entry_id for e in rest] == [ids[2]]
        assert await w2.reclaim_from_dead(0) == []

    run(redis_server.url, test)


def test_claims_from_the_dead_pass_over_the_living_and_share_one_count_among_the_dead(redis_server):
    async def test(redis, w1, w2):
        await add(redis, w1.stream, *(b"%d" % i for i in range(7)))
        holders = {name: RedisBridge(redis, KEYS, MODEL, name) for name in ("w1", "w3", "w4")}
        for holder in holders.values():
            await holder.ensure_group()
        for name, n in (("w1", 2), ("w2", 1), ("w3", 2), ("w4", 2)):  # the summary lists them by name
            await (w2 if name == "w2" else holders[name]).read(n, None)
        await redis.set(KEYS.alive(MODEL, "w1"), b"x")  # w1 beats; w3 and w4 do not
        claimed = await w2.reclaim_from_dead(3)
        assert [e.data for e in claimed] == [b"3", b"4", b"5"]  # both of w3's, then one of w4's
        assert len(await pending_of(redis, w2.stream, consumername="w4")) == 1
        assert len(await pending_of(redis, w2.stream, consumername="w1")) == 2

    run(redis_server.url, test)


def test_the_own_stream_of_a_dead_worker_moves_onto_the_shared_stream_with_its_deliveries(redis_server):
    async def test(redis, w1, w2):
        await add(redis, w1.own, b"read", b"unread")
        await w1.read(1, None)
        await redis.set(KEYS.alive(MODEL, "w1"), b"x")
        assert await w2.adopt_dead_routed() == 0  # alive
        await add(redis, w2.own, b"w2's own")
        await redis.delete(KEYS.alive(MODEL, "w1"), KEYS.alive(MODEL, "w2"))
        await add(redis, KEYS.routed(MODEL, "w3"), b"w3's own")
        assert await w2.adopt_dead_routed() == 3  # w1's and w3's; never its own, beating or not
        assert not await redis.exists(w1.own) and await redis.xlen(w2.own) == 1
        moved = await w2.read(5, None)
        assert sorted((e.data, e.deliveries) for e in moved if not e.entry_id.startswith(OWN)) == [
            (b"read", 2), (b"unread", 1), (b"w3's own", 1)]

    run(redis_server.url, test)


def test_an_entrys_deliveries_are_the_most_that_redis_or_the_entry_itself_counts(redis_server):
    async def test(redis, w1, w2):
        await add(redis, w1.stream, b"a")
        entry = (await w1.read(1, None))[0]
        assert (await w1.with_deliveries(entry)).deliveries == 1
        moved = Entry(entry.entry_id, entry.data, 4)  # moved from a dead worker's own stream after 3
        assert (await w1.with_deliveries(moved)) == moved
        await w2.reclaim(0, 1)
        assert (await w2.with_deliveries(entry)).deliveries == 2
        gone = Entry("1-1", b"x", 3)  # not pending anywhere: its own count stands
        assert await w1.with_deliveries(gone) == gone

    run(redis_server.url, test)


def test_heartbeats_keep_only_what_is_still_held_and_renew_the_workers_keys(redis_server):
    async def test(redis, w1, w2):
        shared = await add(redis, w1.stream, b"a", b"b")
        await add(redis, w1.own, b"o")
        entries = await w1.read(5, None)
        ids = [e.entry_id for e in entries]
        await redis.xclaim(w1.stream, w1.group, "w2", 0, [shared[1]])  # another worker took one
        await asyncio.sleep(0.05)
        kept = await w1.heartbeat(ids + ["1-1"], 10.0, {"num_requests_running": 3}, b"info")
        assert kept == {ids[0], ids[1]}  # own + the first shared; not the taken one, not an unknown id
        idle = {e["message_id"].decode(): e["time_since_delivered"]
                for e in await redis.xpending_range(w1.stream, w1.group, "-", "+", 10)}
        assert idle[shared[0]] < 50  # its idle time reset
        for key in (KEYS.alive(MODEL, "w1"), KEYS.worker_info(MODEL, "w1"), KEYS.metrics(MODEL, "w1")):
            assert 9000 < await redis.pttl(key) <= 10_000
        assert await redis.get(KEYS.alive(MODEL, "w1")) == w1.token.encode()
        assert await redis.get(KEYS.worker_info(MODEL, "w1")) == b"info"
        assert await redis.hgetall(KEYS.metrics(MODEL, "w1")) == {b"num_requests_running": b"3"}
        assert await w2.heartbeat([], 2.0, {}, b"i2") == set()
        assert not await redis.exists(KEYS.metrics(MODEL, "w2"))

    run(redis_server.url, test)


def test_heartbeats_of_many_entries_go_in_slices(redis_server, monkeypatch):
    async def test(redis, w1, _):
        await redis.xadd(w1.stream, {"data": b"x"})
        ids = [e.entry_id for e in await w1.read(1, None)]
        many = [f"{i + 1}-0" for i in range(1200)] + ids  # not held: each slice's script answers for its own
        assert await w1.heartbeat(many, 1.0, {}, b"i") == set(ids)

    run(redis_server.url, test)


def event(request_id: str, seq: int, done: bool = False) -> WireEvent:
    return WireEvent(request_id, seq, done=done, finish_reason="stop" if done else None)


@pytest.mark.parametrize("where", ["server", "cluster"])
def test_a_batch_goes_out_once_per_target_in_order_and_acks_follow_the_terminal_events(redis_server, tmp_path, where):
    from pagedserve.embedded_redis import RedisClusterServers

    async def test(redis, w1, _):
        ids = await add(redis, w1.stream, b"a", b"b")
        await w1.read(2, None)
        a, b = ReplyTarget("channel", "replies:a"), ReplyTarget("stream", "{replies}:b")
        async with redis.pubsub() as sub:
            await sub.subscribe(a.name)
            await sub.get_message(timeout=1)
            # rb's entry rides along on an event that does not end it: not acknowledged
            failed = await w1.publish([Outgoing(a, event("ra", 0), ids[0]), Outgoing(b, event("rb", 0), ids[1]),
                                       Outgoing(a, event("ra", 1, done=True), ids[0])])
            assert failed == []
            async with asyncio.timeout(10):
                while (message := await sub.get_message(timeout=1)) is None:
                    pass
        assert [(e.id, e.seq, e.done) for e in decode_events(message["data"])] == [("ra", 0, False), ("ra", 1, True)]
        assert [[(e.id, e.seq) for e in decode_events(d)] for d in await datas(redis, b.name)] == [[("rb", 0)]]
        assert not await w1.was_streamed("ra")  # started and finished in one batch: the mark is gone again
        assert await w1.was_streamed("rb") and await redis.get(KEYS.streamed("rb")) == b"1"
        assert 0 < await redis.ttl(KEYS.streamed("rb")) <= bridge_module.STREAMED_TTL_S
        assert list(await pending_of(redis, w1.stream)) == [ids[1]] and await redis.xlen(w1.stream) == 1

        await redis.set("replies:wrong", b"a string")  # a target Redis refuses fails its own events only
        wrong = ReplyTarget("stream", "replies:wrong")
        failed = await w1.publish([Outgoing(wrong, event("rw", 1)), Outgoing(b, event("rb", 1, done=True), ids[1])])
        assert [(target, "WRONGTYPE" in str(err)) for target, err in failed] == [(wrong, True)]
        assert len(await datas(redis, b.name)) == 2 and await redis.xlen(w1.stream) == 0
        assert not await w1.was_streamed("rb") and not await w1.was_streamed("rw")  # marked at seq 0 only

    if where == "server":
        run(redis_server.url, test)
        return
    cluster = RedisClusterServers(tmp_path / "cluster").start()
    try:
        run(cluster.url, test)
    finally:
        cluster.stop()


def test_a_refused_acknowledgement_raises_after_the_replies_went_out(redis_server):
    """Only a reply target may fail on its own; anything else Redis refuses in a batch is raised, so the
    caller sends the batch again (the client drops repeats by ``seq``)."""
    from redis.exceptions import ResponseError

    async def test(redis, w1, _):
        ids = await add(redis, w1.stream, b"a")
        await w1.read(1, None)
        await redis.delete(w1.stream)
        await redis.set(w1.stream, b"no longer a stream")
        target = ReplyTarget("stream", "replies:a")
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await w1.publish([Outgoing(target, event("r", 0, done=True), ids[0])])
        assert len(await datas(redis, target.name)) == 1

    run(redis_server.url, test)


def test_a_lost_connection_while_publishing_raises_for_the_caller_to_send_again(redis_server):
    async def test(redis, w1, _):
        target = ReplyTarget("channel", "replies:a")
        await asyncio.to_thread(redis_server.stop)
        with pytest.raises(Exception):
            await w1.publish([Outgoing(target, event("r", 0))])

    run(redis_server.url, test)


def test_handed_back_entries_are_new_entries_for_others_and_acknowledged_here(redis_server):
    async def test(redis, w1, w2):
        await add(redis, w1.stream, b"a")
        await add(redis, w1.own, b"o")
        entries = await w1.read(5, None)
        await w1.hand_back(entries + [Entry("9-9", None)])
        await w1.hand_back([])
        assert await pending_of(redis, w1.stream) == {} and await redis.xlen(w1.own) == 0
        again = await w2.read(5, None)
        assert [(e.data, e.deliveries) for e in again] == [(b"o", 1), (b"a", 1), (b"", 1)]

    run(redis_server.url, test)


def test_a_dead_letter_keeps_the_entry_the_reason_and_who_gave_up_then_acknowledges(redis_server):
    async def test(redis, w1, _):
        ids = await add(redis, w1.stream, b"poison")
        entry = (await w1.read(1, None))[0]
        await w1.dead_letter(Entry(entry.entry_id, entry.data, 3), "undecodable")
        await w1.dead_letter(Entry("1-1", None), "gone")
        letters = [fields for _, fields in await redis.xrange(KEYS.dead_letter(MODEL))]
        assert letters == [
            {b"data": b"poison", b"reason": b"undecodable", b"entry_id": ids[0].encode(), b"consumer": b"w1", b"deliveries": b"3"},
            {b"data": b"", b"reason": b"gone", b"entry_id": b"1-1", b"consumer": b"w1", b"deliveries": b"1"},
        ]
        assert await pending_of(redis, w1.stream) == {} and await redis.xlen(w1.stream) == 0

    run(redis_server.url, test)


def test_a_leaving_worker_gives_its_own_stream_away_and_stops_beating(redis_server):
    async def test(redis, w1, _):
        await w1.wait_for_name(30, 0, b"info")
        await w1.heartbeat([], 30, {"x": 1}, b"info")
        await add(redis, w1.own, b"o1", b"o2")
        await w1.read(1, None)
        await w1.leave()
        assert await datas(redis, w1.stream) == [b"o1", b"o2"] and not await redis.exists(w1.own)
        for key in (KEYS.alive(MODEL, "w1"), KEYS.worker_info(MODEL, "w1"), KEYS.metrics(MODEL, "w1")):
            assert not await redis.exists(key)

    run(redis_server.url, test)


def test_a_draining_worker_gives_away_only_what_it_never_read(redis_server):
    async def test(redis, w1, _):
        await add(redis, w1.own, b"o1", b"o2", b"o3")
        await w1.read(1, None)
        assert await w1.give_back_unread() == 2
        assert await datas(redis, w1.stream) == [b"o2", b"o3"] and await redis.xlen(w1.own) == 1

    run(redis_server.url, test)


def test_kv_events_are_added_to_the_models_stream_and_trimmed_about_to_the_length(redis_server):
    """About: Redis drops whole nodes of a stream (100 entries each by default), which is cheap; an
    exact trim would cut inside one on every add."""
    async def test(redis, w1, _):
        for i in range(250):
            await w1.publish_kv(b"%d" % i, 100)
        entries = await redis.xrange(KEYS.kv_events(MODEL))
        assert 100 < len(entries) < 250 and entries[-1][1] == {b"data": b"249"}

    run(redis_server.url, test)
