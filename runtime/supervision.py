"""Long-running tasks that never die unseen: an unexpected exception is logged with its traceback
and the task restarts with backoff; a task that keeps failing is given up on, and the service is
told so it can stop with a non-zero exit (compose or systemd then restarts the process)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Awaitable, Callable

import structlog

log = structlog.get_logger("pagedserve.supervision")
# How a service's process ended (the worker, the gateway, ``pagedserve serve``): 0 a clean stop, 1 a
# task that kept failing, 2 could not start, 3 a broken device (the worker: exiting for a restart).
EXIT_CUT = 4  # stopped on time, but requests held were cut short (the drain timeout, or Redis unreachable)


async def supervise(name: str, run: Callable[[], Awaitable[None]], on_give_up: Callable[[str], None], *,
                    max_failures: int = 5, window_s: float = 60.0, first_delay_s: float = 0.1) -> None:
    """Run ``run()`` until it returns (or the task is cancelled), restarting it after failures;
    more than ``max_failures`` within ``window_s`` calls ``on_give_up(name)`` and returns."""
    failures: deque[float] = deque()
    delay = first_delay_s
    while True:
        try:
            await run()
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            now = time.monotonic()
            failures.append(now)
            while failures and failures[0] < now - window_s:
                failures.popleft()
            if len(failures) > max_failures:
                log.exception("task keeps failing; giving up", task=name, failures=len(failures))
                on_give_up(name)
                return
            log.exception("task failed; restarting", task=name, retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
