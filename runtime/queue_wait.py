"""Waiting for a queue's next item with a time limit, without losing a cancel.

``asyncio.wait_for(queue.get(), t)`` before Python 3.12 returns an item that arrived as the waiting
task was cancelled and swallows the cancel (a client gone, its handler streaming on). Here the get
is its own task, awaited with ``asyncio.wait``: a cancel always propagates; an item the getter took
as it came is put back at the queue's end (asyncio.Queue has no other way back in), never lost.
"""

from __future__ import annotations

import asyncio
from typing import Any

MISSING = object()  # get_within's answer when nothing came in time


async def get_within(queue: asyncio.Queue, seconds: float) -> Any:
    """The queue's next item, or ``MISSING`` when none came within ``seconds``."""
    getter = asyncio.ensure_future(queue.get())
    try:
        done, _ = await asyncio.wait((getter,), timeout=max(0.0, seconds))
    except asyncio.CancelledError:
        if getter.done() and not getter.cancelled():
            queue.put_nowait(getter.result())  # taken as the cancel came: not lost
        getter.cancel()
        raise
    if not done:
        getter.cancel()
        return MISSING
    return getter.result()
