"""Supervised tasks: a failure is retried with backoff, a task that keeps failing is given up on."""

import asyncio

import pytest

from pagedserve.runtime.supervision import supervise


def test_a_failing_task_restarts_until_it_finishes():
    calls, gave_up = [], []

    async def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("transient")

    asyncio.run(supervise("flaky", flaky, gave_up.append, first_delay_s=0.001))
    assert len(calls) == 3 and gave_up == []


def test_a_task_that_keeps_failing_is_given_up_on():
    calls, gave_up = [], []

    async def broken():
        calls.append(1)
        raise KeyError("always")

    asyncio.run(asyncio.wait_for(supervise("broken", broken, gave_up.append, max_failures=3, first_delay_s=0.001), 10))
    assert len(calls) == 4 and gave_up == ["broken"]


def test_cancelling_the_supervisor_cancels_the_task():
    async def main():
        started = asyncio.Event()

        async def forever():
            started.set()
            await asyncio.sleep(3600)

        task = asyncio.create_task(supervise("forever", forever, lambda name: None))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
