"""The reply dispatcher (``runtime/replies.py``) on a real redis-server, with no worker or gateway:
its own watch finds a vanished queue entry and says so, what it logs for a batch it cannot read or
an entry it cannot look up, its bounded waits for the subscription (and the subscription lost with
Redis), read-only mailboxes, routed sends, and closing what is not open. The mailbox's side of a
resend is tests/shared/test_replies.py."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from structlog.testing import capture_logs

from pagedserve.runtime.producer import Producer
from pagedserve.runtime.redis_client import connect
from pagedserve.runtime.replies import VANISHED, ReplyDispatcher
from pagedserve.shared.keys import Keys
from pagedserve.shared.protocol import OutputDelta, ReplyTarget, WireEvent, WireRequest, encode_events
from pagedserve.shared.sampling import SamplingParams

KEYS = Keys()


def request(dispatcher: ReplyDispatcher, rid: str) -> WireRequest:
    return WireRequest(id=rid, model="m", params=SamplingParams(), reply=ReplyTarget("channel", dispatcher.channel),
                       prompt_token_ids=[1, 2])


@contextlib.asynccontextmanager
async def dispatcher_on(url: str, start: bool = True, **timing):
    client = connect(url)
    dispatcher = ReplyDispatcher(client, KEYS.replies("t"), Producer(client, KEYS), **timing)
    if start:
        await dispatcher.start()
    try:
        yield dispatcher, client
    finally:
        await dispatcher.stop()
        await client.aclose()


def test_the_defaults_are_a_look_a_second_at_requests_quiet_for_two():
    dispatcher = ReplyDispatcher(None, "c", None)
    assert (dispatcher.watch_every_s, dispatcher.quiet_s) == (1.0, 2.0)


def test_the_watch_sends_a_vanished_request_again_on_its_own_and_says_why(redis_server):
    """No check called by hand: the watch looks every 50 ms at requests quiet for 100 ms, finds the
    entry gone twice, and the mailbox sends the request again with the reason."""
    async def main():
        async with dispatcher_on(redis_server.url, watch_every_s=0.05, quiet_s=0.1) as (dispatcher, client):
            box = dispatcher.open(request(dispatcher, "w"))
            await dispatcher.send([box])
            first_entry = box.entry_id
            await client.xdel(KEYS.requests("m"), first_entry)
            reader = asyncio.create_task(anext(box.events(), None))  # the client reading, as it would be
            with capture_logs() as logs:
                async with asyncio.timeout(10):
                    while not any(e["event"] == "request sent again" for e in logs):
                        await asyncio.sleep(0.02)
            reader.cancel()
            assert box.wire_id == "w~1"
            return first_entry, logs

    first_entry, logs = asyncio.run(main())
    assert {"event": "queue entry vanished; sending the request again", "log_level": "warning", "request_id": "w",
            "entry_id": first_entry} in logs
    assert [(e["event"], e["why"]) for e in logs if e["event"] == "request sent again"] == [("request sent again", VANISHED)]


def test_after_a_resend_two_more_misses_are_needed(redis_server):
    """The count of misses starts again once a request is sent again: one later miss is not enough."""
    async def main():
        async with dispatcher_on(redis_server.url, watch_every_s=3600, quiet_s=0.0) as (dispatcher, client):
            box = dispatcher.open(request(dispatcher, "x"))
            await dispatcher.send([box])
            sent = []
            box.put = sent.append  # what the checks hand the mailbox, not acted on
            await client.xdel(KEYS.requests("m"), box.entry_id)
            await dispatcher.check_entries()
            await dispatcher.check_entries()
            after_two, count = len(sent), box.missing_checks
            await dispatcher.check_entries()
            after_three = len(sent)
            await dispatcher.check_entries()
            return after_two, count, after_three, sent

    after_two, count, after_three, sent = asyncio.run(main())
    assert (after_two, count, after_three, len(sent)) == (1, 0, 1, 2)
    assert sent[0].finish_reason == "error" and sent[0].error == VANISHED and sent[0].id == "x"


def test_a_check_that_fails_is_logged_and_the_watch_goes_on(redis_server):
    """Another kind of key under the stream's name: the look-up fails, the watch says so and keeps
    looking; once the key is a stream again the vanished entry is found."""
    async def main():
        async with dispatcher_on(redis_server.url, watch_every_s=0.05, quiet_s=0.0) as (dispatcher, client):
            box = dispatcher.open(request(dispatcher, "y"))
            await dispatcher.send([box])
            stream = KEYS.requests("m")
            with capture_logs() as logs:
                await client.delete(stream)
                await client.set(stream, "not a stream")
                async with asyncio.timeout(10):
                    while not any(e["event"] == "checking queue entries failed" for e in logs):
                        await asyncio.sleep(0.02)
                await client.delete(stream)
                box.put = lambda event: logs.append({"event": "put", "error": event.error})
                async with asyncio.timeout(10):
                    while not any(e["event"] == "put" for e in logs):
                        await asyncio.sleep(0.02)
            return logs

    logs = asyncio.run(main())
    failed = next(e for e in logs if e["event"] == "checking queue entries failed")
    assert failed["log_level"] == "error" and failed["exc_info"] is True  # with the exception's traceback
    assert {"event": "put", "error": VANISHED} in logs


def test_an_undecodable_batch_is_logged_with_its_error_and_later_ones_still_arrive(redis_server):
    async def main():
        async with dispatcher_on(redis_server.url, watch_every_s=3600) as (dispatcher, client):
            box = dispatcher.open("plain")  # a read-only mailbox: a bare id, nothing to send again
            with capture_logs() as logs:
                await client.publish(dispatcher.channel, b"\xc1 not a batch")
                await client.publish(dispatcher.channel, encode_events(
                    [WireEvent("plain", 0, [OutputDelta(0, [7], "x", "stop")], True, "stop")]))
                got = await asyncio.wait_for(anext(box.events()), 5)
            return box, got, logs

    box, got, logs = asyncio.run(main())
    assert box.request_id == "plain" and box.request is None and (got.id, got.seq, got.done) == ("plain", 0, True)
    [warning] = [e for e in logs if e["event"] == "undecodable reply batch"]
    assert warning["log_level"] == "warning" and warning["error"] and warning["error"] != "None"


def test_waiting_for_the_subscription_is_bounded_and_names_the_channel(redis_server):
    async def main():
        async with dispatcher_on(redis_server.url, start=False) as (dispatcher, _):
            box = dispatcher.open(request(dispatcher, "z"))
            async with asyncio.timeout(5):
                with pytest.raises(RedisConnectionError) as ready:
                    await dispatcher.ready(0.2)
                with pytest.raises(RedisConnectionError):
                    await dispatcher.send([box], subscribe_timeout=0.2)
            return str(ready.value), dispatcher.channel

    message, channel = asyncio.run(main())
    assert message == f"not subscribed to {channel} (Redis unreachable?)"


def test_the_subscription_is_known_lost_when_redis_goes(redis_server):
    async def main():
        async with dispatcher_on(redis_server.url, watch_every_s=3600) as (dispatcher, _):
            await dispatcher.ready(1.0)
            redis_server.stop()
            async with asyncio.timeout(10):
                while True:  # lost within the listener's read timeout
                    try:
                        await dispatcher.ready(0.1)
                    except RedisConnectionError:
                        return True
                    await asyncio.sleep(0.05)

    assert asyncio.run(main())


def test_a_routed_send_lands_on_its_stream_and_closing_twice_is_harmless(redis_server):
    async def main():
        async with dispatcher_on(redis_server.url, watch_every_s=3600) as (dispatcher, client):
            box = dispatcher.open(request(dispatcher, "routed"))
            routed = KEYS.routed("m", "w1")
            await dispatcher.send([box], [routed])
            on_routed = [WireRequest.decode(f[b"data"]).id for _, f in await client.xrange(routed)]
            on_model = await client.xrange(KEYS.requests("m"))
            dispatcher.close(box)
            dispatcher.close(box)
            return box, routed, on_routed, on_model

    box, routed, on_routed, on_model = asyncio.run(main())
    assert on_routed == ["routed"] and on_model == [] and box.stream == routed
