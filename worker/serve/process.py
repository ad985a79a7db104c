"""The worker process: the engine loop on the main thread, the Redis I/O on a second one.

Whichever thread runs the engine does all the torch work; the main thread is where the CPU thread
pool is fastest (measured: a small model stepped 45% slower on a second thread after the main one
had used torch). SIGTERM and SIGINT start the drain.
"""

from __future__ import annotations

import asyncio
import signal
import threading

from pagedserve.worker.serve.bridge import ConsumerNameTaken
from pagedserve.worker.serve.service import WorkerService


def serve_on_main_thread(service: WorkerService) -> int:
    """Serve until SIGTERM/SIGINT; the exit code (0 after a clean drain, 1 after giving up)."""
    started, box = threading.Event(), {}

    def io() -> None:
        async def main() -> int:
            box["loop"], box["engine_done"] = asyncio.get_running_loop(), asyncio.Event()
            started.set()
            return await service.serve_io(box["engine_done"].wait)

        try:
            box["rc"] = asyncio.run(main())
        except ConsumerNameTaken as err:
            box["error"] = err

    thread = threading.Thread(target=io, name="pagedserve-io")
    thread.start()
    started.wait()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: box["loop"].call_soon_threadsafe(service.request_stop))
    try:
        service.engine_loop.run()
    finally:
        box["loop"].call_soon_threadsafe(box["engine_done"].set)
        thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("rc", 1)
