"""The reply mailbox: events in order, duplicates from a resend dropped, a gap an error, bounded;
a request whose worker died mid-stream sent again (resumed) when it can be, an error when not; a
worker that lost its entry and sends late never mixed into the new holder's events."""

import asyncio
import time
from dataclasses import replace

import pytest
from structlog.testing import capture_logs

from pagedserve.runtime.mailbox import MAX_RESENDS, Mailbox, failure
from pagedserve.shared.protocol import OutputDelta, ReplyTarget, Resume, WireEvent, WireRequest
from pagedserve.shared.sampling import SamplingParams
from tests.service_helpers import messages, subscribed


def event(seq: int, done: bool = False, tokens=(1,), request_id: str = "r") -> WireEvent:
    return WireEvent(request_id, seq, [OutputDelta(0, list(tokens), "x", "length" if done else None, None)], done,
                     "length" if done else None)


def drain(box: Mailbox) -> list[WireEvent]:
    async def main():
        return [e async for e in box.events()]

    return asyncio.run(asyncio.wait_for(main(), 5))


def test_duplicates_are_dropped_and_order_kept():
    box = Mailbox("r")
    for seq in (0, 1, 1, 0, 2):
        box.put(event(seq))
    box.put(event(3, done=True))
    got = drain(box)
    assert [e.seq for e in got] == [0, 1, 2, 3] and got[-1].done and box.done


def test_a_gap_ends_the_request_with_an_error_naming_it():
    box = Mailbox("r")
    for seq in (0, 1, 4):
        box.put(event(seq))
    got = drain(box)
    assert [e.seq for e in got[:-1]] == [0, 1]
    assert got[-1].done and got[-1].finish_reason == "error" and "2..3" in got[-1].error


def test_a_consumer_too_far_behind_gets_an_error_not_unbounded_memory():
    box = Mailbox("r", limit=3)
    for seq in range(5):
        box.put(event(seq))
    got = drain(box)
    assert len(got) == 1 and got[0].finish_reason == "error" and "fell too far behind" in got[0].error


def test_events_after_the_end_are_ignored():
    box = Mailbox("r")
    box.put(event(0, done=True))
    assert [e.seq for e in drain(box)] == [0]
    box.put(event(1))
    assert drain(box) == []


def kept(params: SamplingParams, sent: list):
    """A mailbox holding its request, whose re-sends land in ``sent`` (entry ids e-1, e-2 …)."""
    async def resend(req, old_id):
        assert old_id == (sent[-1].id if sent else "r")  # the attempt given up on is the latest
        sent.append(req)
        return f"e-{len(sent)}"

    request = WireRequest(id="r", model="m", params=params, reply=ReplyTarget("channel", "c"), prompt_token_ids=[1, 2])
    return Mailbox("r", request=request, resend=resend)


def lost(request_id: str = "r") -> WireEvent:
    return failure(request_id, "the worker serving this request died mid-stream", resumable=True)


def drain_with_attempts(box: Mailbox, sent: list, first: list[WireEvent], later: list[list[WireEvent]]) -> list[WireEvent]:
    """Read ``box`` while its attempts answer: ``first`` at once, ``later[k]`` once attempt k+1 was sent."""
    async def answer():
        for e in first:
            box.put(e)
        for attempt, events in enumerate(later, start=1):
            while len(sent) < attempt:
                await asyncio.sleep(0.001)
            for e in events:
                box.put(e)

    async def main():
        feeder = asyncio.create_task(answer())
        got = [e async for e in box.events()]
        await feeder
        return got

    return asyncio.run(asyncio.wait_for(main(), 5))


def test_a_request_whose_worker_died_mid_stream_is_resumed_from_what_was_delivered():
    sent: list = []
    box = kept(SamplingParams(max_tokens=9), sent)
    with capture_logs() as logs:
        got = drain_with_attempts(box, sent, [event(0, tokens=(5, 6)), event(1, tokens=(7,)), lost()], [
            [event(2, tokens=(99,)), event(2, tokens=(8,), request_id="r~1"), event(3, done=True, request_id="r~1")]])
    # what an operator reads: which request went again, why, from where
    assert [e for e in logs if e["event"] == "request sent again"] == [{
        "event": "request sent again", "log_level": "info", "request_id": "r", "tokens_delivered": 3, "next_seq": 2,
        "why": "the worker serving this request died mid-stream"}]
    assert [e.seq for e in got] == [0, 1, 2, 3] and got[-1].finish_reason == "length"
    assert [t for e in got for o in e.outputs for t in o.token_ids] == [5, 6, 7, 8, 1]  # not 99: the old attempt's
    assert all(e.id == "r" for e in got)  # the reader sees its own id whatever the attempt
    assert [(r.id, r.resume) for r in sent] == [("r~1", Resume([5, 6, 7], 2))] and box.entry_id == "e-1"


def held(e: WireEvent, delivery: int) -> WireEvent:
    return replace(e, delivery=delivery)


def test_events_from_a_holder_whose_entry_was_taken_over_are_dropped():
    """Worker A (delivery 1) was cut off before anything reached the reader; B (delivery 2) took
    the entry and ran it from the prompt; A's late events, before and after B's, are ignored."""
    box = Mailbox("r")
    for e in (held(event(0, tokens=(40,)), 2), held(event(0, tokens=(99,)), 1), held(event(1, tokens=(98,)), 1),
              held(event(1, tokens=(41,)), 2), held(event(2, done=True, tokens=(42,)), 2)):
        box.put(e)
    got = drain(box)
    assert [t for e in got for o in e.outputs for t in o.token_ids] == [40, 41, 42] and got[-1].done


def test_a_new_holder_after_events_went_out_resumes_from_what_the_reader_has():
    """A's events reached the reader late, after B had started over from the prompt not knowing
    them: B's run cannot follow them, so the request goes again from what the reader holds."""
    sent: list = []
    box = kept(SamplingParams(max_tokens=9), sent)
    got = drain_with_attempts(box, sent, [held(event(0, tokens=(5, 6)), 1), held(event(1, tokens=(77,)), 2)],
                              [[held(event(1, tokens=(7,), request_id="r~1"), 1),
                                held(event(2, done=True, tokens=(8,), request_id="r~1"), 1)]])
    assert [t for e in got for o in e.outputs for t in o.token_ids] == [5, 6, 7, 8]  # never B's 77
    assert [(r.id, r.resume) for r in sent] == [("r~1", Resume([5, 6], 1))]  # the new attempt counts from 1 again


def test_events_that_say_no_holder_are_taken_as_before():
    box = Mailbox("r")
    for e in (event(0), held(event(1), 1), event(2, done=True)):
        box.put(e)
    assert [e.seq for e in drain(box)] == [0, 1, 2]


def test_a_gap_in_a_resumable_request_is_resumed_from_before_the_gap():
    sent: list = []
    box = kept(SamplingParams(max_tokens=9), sent)
    got = drain_with_attempts(box, sent, [event(0, tokens=(5,)), event(3)],
                              [[event(1, request_id="r~1"), event(2, done=True, request_id="r~1")]])
    assert [e.seq for e in got] == [0, 1, 2] and got[-1].done and got[-1].finish_reason == "length"
    assert [(r.id, r.resume) for r in sent] == [("r~1", Resume([5], 1))]


def test_a_request_lost_before_any_event_is_sent_again_whole_even_with_n_samples():
    sent: list = []
    box = kept(SamplingParams(n=2), sent)
    got = drain_with_attempts(box, sent, [lost()], [[event(0, done=True, request_id="r~1")]])
    assert [e.seq for e in got] == [0]
    assert len(sent) == 1 and sent[0].resume is None


@pytest.mark.parametrize("params", [SamplingParams(n=2), SamplingParams(best_of=2), SamplingParams(use_beam_search=True, beam_width=2)])
def test_a_request_that_cannot_resume_ends_with_the_error(params):
    sent: list = []
    box = kept(params, sent)
    got = drain_with_attempts(box, sent, [event(0), lost()], [])
    assert [e.seq for e in got] == [0, -1] and "died mid-stream" in got[-1].error and sent == []


def test_re_sending_gives_up_after_a_few_tries():
    sent: list = []
    box = kept(SamplingParams(), sent)
    got = drain_with_attempts(box, sent, [lost()], [[lost(f"r~{k}")] for k in range(1, MAX_RESENDS + 1)])
    assert len(sent) == MAX_RESENDS and [e.seq for e in got] == [-1] and got[0].finish_reason == "error"


def test_an_error_not_marked_resumable_is_not_retried():
    sent: list = []
    box = kept(SamplingParams(), sent)
    box.put(failure("r", "out of memory"))
    assert [e.error for e in drain(box)] == ["out of memory"] and sent == []


def test_the_limit_is_exact_and_the_overflow_says_so():
    box = Mailbox("r", limit=3)
    for seq in range(3):
        box.put(event(seq))  # three fit
    box.put(event(3, done=True))  # the fourth does not
    got = drain(box)
    assert len(got) == 1 and got[0].error == "the client fell too far behind; events were dropped"
    full = Mailbox("r", limit=3)
    for seq in range(2):
        full.put(event(seq))
    full.put(event(2, done=True))
    assert [e.seq for e in drain(full)] == [0, 1, 2]


def test_an_attempt_id_keeps_within_the_wire_limit():
    from pagedserve.runtime.mailbox import attempt_id
    from pagedserve.shared.protocol import MAX_ID_LEN

    assert attempt_id("x" * MAX_ID_LEN, 3) == "x" * (MAX_ID_LEN - 8) + "~3"
    assert attempt_id("r", 1) == "r~1" and failure("r", "why").outputs == []


def test_an_old_attempts_events_queued_before_the_resend_are_skipped_not_the_end():
    """Events of the attempt given up on may already wait in the mailbox when it is sent again:
    they are passed over, and the new attempt's events still come."""
    sent: list = []
    box = kept(SamplingParams(max_tokens=9), sent)
    got = drain_with_attempts(box, sent, [event(0, tokens=(5,)), lost(), event(1, tokens=(99,))],
                              [[event(1, tokens=(6,), request_id="r~1"), event(2, done=True, request_id="r~1")]])
    assert [e.seq for e in got] == [0, 1, 2] and [t for e in got for o in e.outputs for t in o.token_ids] == [5, 6, 1]


def test_the_last_error_after_a_resend_carries_the_readers_id_and_ends_the_box():
    sent: list = []
    box = kept(SamplingParams(max_tokens=9), sent)
    box.missing_checks = 2  # the dispatcher had found the first attempt's entry missing twice
    got = drain_with_attempts(box, sent, [lost()], [[failure("r~1", "out of memory")]])
    assert [(e.id, e.error) for e in got] == [("r", "out of memory")]
    assert box.done and box.missing_checks == 0 and box.wire_id == "r~1"


def test_a_resend_that_cannot_reach_redis_or_has_no_sender_ends_with_the_error():
    async def down(req, old_id):
        raise ConnectionError("redis is down")

    request = WireRequest(id="r", model="m", params=SamplingParams(), reply=ReplyTarget("channel", "c"), prompt_token_ids=[1])
    for box in (Mailbox("r", request=request, resend=down), Mailbox("r", request=request)):
        box.put(lost())
        with capture_logs() as logs:
            got = drain(box)
        assert [e.seq for e in got] == [-1] and "died mid-stream" in got[0].error and box.done
    assert logs == [] and box.heard_at <= time.monotonic()
    box = Mailbox("r", request=request, resend=down)
    box.put(lost())
    with capture_logs() as logs:
        drain(box)
    assert logs == [{"event": "could not send the request again", "log_level": "warning", "request_id": "r",
                     "error": "redis is down"}]


def test_a_request_whose_queue_entry_vanished_is_sent_again_after_two_checks(redis_server):
    """The dispatcher looks up the stream entry of every request quiet for ``quiet_s``: one found
    gone twice in a row (Redis restarted empty, say) gets a resumable error and is sent again; one
    still there, or heard from lately, is left alone. Real Redis, checks called one at a time."""
    from pagedserve.runtime.producer import Producer
    from pagedserve.runtime.redis_client import connect
    from pagedserve.runtime.replies import ReplyDispatcher
    from pagedserve.shared.keys import Keys

    async def main():
        r = connect(redis_server.url)
        keys = Keys()
        dispatcher = ReplyDispatcher(r, keys.replies("test"), Producer(r, keys), watch_every_s=3600, quiet_s=0.0)
        await dispatcher.start()
        try:
            def request(rid: str) -> WireRequest:
                return WireRequest(id=rid, model="m", params=SamplingParams(), reply=ReplyTarget("channel", dispatcher.channel),
                                   prompt_token_ids=[1, 2])

            gone, kept, quiet = (dispatcher.open(request(rid)) for rid in ("gone", "kept", "heard"))
            await dispatcher.send([gone, kept, quiet])
            first_entry = gone.entry_id
            await r.xdel(keys.requests("m"), gone.entry_id, quiet.entry_id)
            dispatcher.quiet_s = 1.0
            quiet.heard_at = float("inf")  # an event just came: not checked however its entry fares
            gone.heard_at = kept.heard_at = 0.0
            await dispatcher.check_entries()
            after_one = (gone.missing_checks, kept.missing_checks, quiet.missing_checks, gone.wire_id)
            quiet.heard_at = 0.0
            quiet.put(WireEvent("heard", 0))  # an event: heard from now, so not looked up again yet
            assert quiet.heard_at > time.monotonic() - 5
            reader = asyncio.create_task(anext(gone.events(), None))  # the client reading, as it would be
            await dispatcher.check_entries()
            async with asyncio.timeout(5):
                while gone.wire_id == "gone":  # the reader sends it again on the resumable error
                    await asyncio.sleep(0.01)
            reader.cancel()
            assert gone.heard_at > time.monotonic() - 5  # just sent again: quiet only from now
            await dispatcher.check_entries()
            assert quiet.missing_checks == 0 and gone.missing_checks == 0
            stream = [e for _, e in await r.xrange(keys.requests("m"))]
            return after_one, gone, first_entry, stream
        finally:
            await dispatcher.stop()
            await r.aclose()

    after_one, gone, first_entry, stream = asyncio.run(main())
    assert after_one == (1, 0, 0, "gone")
    assert gone.wire_id == "gone~1" and gone.missing_checks == 0 and gone.entry_id != first_entry
    assert [WireRequest.decode(e[b"data"]).id for e in stream] == ["kept", "gone~1"]


def test_the_producer_pushes_onto_each_requests_stream_and_publishes_every_cancel(redis_url):
    """``runtime/producer.py`` on a server and on a cluster (where PUBLISH stays out of pipelines):
    requests onto their model's stream or the stream named for them, in order, with their entry
    ids; cancels on the model's cancel channel, one message per id; no ids, no message."""
    from pagedserve.runtime.producer import Producer
    from pagedserve.runtime.redis_client import connect
    from pagedserve.shared.keys import Keys
    from pagedserve.shared.protocol import WireCancel

    keys = Keys()

    def request(rid: str, model: str = "m") -> WireRequest:
        return WireRequest(id=rid, model=model, params=SamplingParams(), reply=ReplyTarget("channel", keys.replies("c")),
                           prompt_token_ids=[1])

    async def main():
        r = connect(redis_url)
        listener = connect(redis_url)
        try:
            producer = Producer(r, keys)
            routed = keys.routed("m", "w1")
            ids = await producer.enqueue([request("a"), request("b", "other"), request("c")], [None, None, routed])
            streams = {name: [(eid.decode(), WireRequest.decode(f[b"data"]).id) for eid, f in await r.xrange(name)]
                       for name in (keys.requests("m"), keys.requests("other"), routed)}
            await listener.initialize()  # a cluster client learns its slots first (its pub/sub needs them)
            pubsub = listener.pubsub()
            await subscribed(pubsub, keys.cancel("m"))
            await producer.cancel("m", [], "nothing")
            await producer.cancel("m", ["a", "c"], "client gone")
            got = [WireCancel.decode(data) for data in await messages(pubsub, 2)]
            extra = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.3)
            await pubsub.aclose()
            return ids, streams, got, extra
        finally:
            await r.aclose()
            await listener.aclose()

    ids, streams, got, extra = asyncio.run(main())
    assert streams == {keys.requests("m"): [(ids[0], "a")], keys.requests("other"): [(ids[1], "b")],
                       keys.routed("m", "w1"): [(ids[2], "c")]}
    assert all(isinstance(i, str) for i in ids)
    assert got == [WireCancel("a", "client gone"), WireCancel("c", "client gone")] and extra is None


def test_the_dispatcher_delivers_each_attempts_events_to_its_box_and_cancels_the_old_one(redis_server):
    """Events published on the dispatcher's channel reach the box of their id (an undecodable batch
    is skipped, an unknown id dropped); a box sent again answers to the new attempt's id, the old
    attempt is cancelled on the model's channel, ``wire_id`` names the attempt on the wire, and a
    closed box hears nothing more."""
    from pagedserve.runtime.producer import Producer
    from pagedserve.runtime.redis_client import connect
    from pagedserve.runtime.replies import ReplyDispatcher
    from pagedserve.shared.keys import Keys
    from pagedserve.shared.protocol import WireCancel, encode_events

    keys = Keys()

    async def main():
        r, listener = connect(redis_server.url), connect(redis_server.url)
        dispatcher = ReplyDispatcher(r, keys.replies("d"), Producer(r, keys), watch_every_s=3600)
        await dispatcher.start()
        cancels = listener.pubsub()
        await subscribed(cancels, keys.cancel("m"))
        try:
            request = WireRequest(id="r", model="m", params=SamplingParams(max_tokens=4), prompt_token_ids=[1],
                                  reply=ReplyTarget("channel", dispatcher.channel))
            box = dispatcher.open(request)
            await dispatcher.send([box])
            assert dispatcher.wire_id("r") == "r" and dispatcher.wire_id("unknown") == "unknown"
            await r.publish(dispatcher.channel, b"\xc1 not a batch")
            await r.publish(dispatcher.channel, encode_events([event(0, tokens=(5,)), event(0, request_id="other")]))
            reader = box.events()
            first = await asyncio.wait_for(anext(reader), 5)
            await r.publish(dispatcher.channel, encode_events([lost()]))
            second = asyncio.create_task(anext(reader))  # the reader sends it again, then waits
            async with asyncio.timeout(5):
                while box.wire_id == "r":
                    await asyncio.sleep(0.01)
            assert dispatcher.wire_id("r") == "r~1"
            await r.publish(dispatcher.channel, encode_events([event(1, tokens=(99,)), event(1, tokens=(6,), request_id="r~1")]))
            resumed = await asyncio.wait_for(second, 5)
            cancelled = [WireCancel.decode(data) for data in await messages(cancels, 1, timeout=5)]
            dispatcher.close(box)
            await r.publish(dispatcher.channel, encode_events([event(2, done=True, request_id="r~1")]))
            await asyncio.sleep(0.3)
            stream = [WireRequest.decode(f[b"data"]) for _, f in await r.xrange(keys.requests("m"))]
            return first, resumed, cancelled, box, stream
        finally:
            await cancels.aclose()
            await dispatcher.stop()
            await r.aclose()
            await listener.aclose()

    first, resumed, cancelled, box, stream = asyncio.run(main())
    assert (first.id, first.seq, first.outputs[0].token_ids) == ("r", 0, [5])
    assert (resumed.id, resumed.seq, resumed.outputs[0].token_ids) == ("r", 1, [6])  # the new attempt's, not 99
    assert cancelled == [WireCancel("r", "sent again")]
    assert [(q.id, q.resume) for q in stream] == [("r", None), ("r~1", Resume([5], 1))]
    assert box.entry_id is not None and not box._events  # closed: the last event was not delivered


def test_the_dispatcher_stops_by_its_flag_without_cancelling_its_tasks(redis_server):
    """``stop`` sets the flag and both tasks return (a gateway's shutdown waited 2 s on the watcher's
    sleep, then cancelled it, before this)."""
    from pagedserve.runtime.producer import Producer
    from pagedserve.runtime.redis_client import connect
    from pagedserve.runtime.replies import ReplyDispatcher
    from pagedserve.shared.keys import Keys

    async def main():
        r = connect(redis_server.url)
        dispatcher = ReplyDispatcher(r, Keys().replies("s"), Producer(r, Keys()), watch_every_s=3600)
        await dispatcher.start()
        tasks = list(dispatcher._tasks)
        await dispatcher.stop()
        await r.aclose()
        return tasks

    tasks = asyncio.run(main())
    assert len(tasks) == 2 and all(task.done() and not task.cancelled() for task in tasks)
