"""``get_within`` (runtime/queue_wait.py): a queue's next item within a time limit, where a cancel is
never swallowed (``asyncio.wait_for`` before Python 3.12 returned an item that arrived as the waiter
was cancelled, and the client-gone handler streamed on) and an item taken as the cancel came is put
back, not lost."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.runtime.queue_wait import MISSING, get_within


def test_the_next_item_or_missing_when_none_came_in_time():
    async def go():
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait("a")
        first = await get_within(queue, 1.0)
        nothing = await get_within(queue, 0.01)
        asyncio.get_running_loop().call_later(0.01, queue.put_nowait, "b")
        return first, nothing, await get_within(queue, 5.0), await get_within(queue, -1.0)

    assert asyncio.run(go()) == ("a", MISSING, "b", MISSING)


def test_a_cancel_as_an_item_arrives_propagates_and_the_item_stays_in_the_queue():
    async def go():
        queue: asyncio.Queue = asyncio.Queue()
        waiter = asyncio.create_task(get_within(queue, 5.0))
        await asyncio.sleep(0.01)  # waiting on the empty queue
        queue.put_nowait("item")  # the getter's future is resolved now, its task not yet run ...
        waiter.cancel()  # ... and the waiter is cancelled in the same turn: the race wait_for lost
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.sleep(0)
        return [queue.get_nowait() for _ in range(queue.qsize())]

    assert asyncio.run(go()) == ["item"]


def test_a_cancel_while_nothing_came_propagates_and_leaves_the_queue_as_it_was():
    async def go():
        queue: asyncio.Queue = asyncio.Queue()
        waiter = asyncio.create_task(get_within(queue, 5.0))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        queue.put_nowait("later")  # no getter left behind to take it
        await asyncio.sleep(0)
        return queue.get_nowait()

    assert asyncio.run(go()) == "later"
