"""The reply mailbox: events in order, duplicates from a resend dropped, a gap an error, bounded."""

import asyncio

from shared.protocol import OutputDelta, WireEvent
from shared.replies import Mailbox


def event(seq: int, done: bool = False, tokens=(1,)) -> WireEvent:
    return WireEvent("r", seq, [OutputDelta(0, list(tokens), "x", "length" if done else None, None)], done,
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
