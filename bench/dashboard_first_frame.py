"""How long a newly opened KV dashboard waits for its first picture: milliseconds from sending
``GET /dashboard/events`` to its first ``worker`` frame, on a local stack (redis-server, a worker on
the demo model, the gateway).

Two kinds of opening: **cold**, the first dashboard after none was open for longer than the
gateway keeps a worker's last snapshot (``gateway/dashboard/hub.py``: ``STALE_S``), where the picture must come
from the worker (the gateway's wake asks for it); **warm**, a page opened again at once, answered
from the snapshot the gateway keeps. Each kind idle and with ``--streams`` requests generating.

    python -m bench.dashboard_first_frame [--repeat 3] [--streams 16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time

import aiohttp

from pagedserve.bench.table import print_table
from pagedserve.gateway.dashboard.hub import STALE_S, WATCH_TTL_MS


async def first_worker_frame_ms(http: aiohttp.ClientSession, url: str) -> float:
    started = time.perf_counter()
    async with http.get(url + "/dashboard/events") as feed:
        async with asyncio.timeout(30):
            async for line in feed.content:
                if line.startswith(b"event: worker"):
                    return 1000 * (time.perf_counter() - started)
    raise RuntimeError("the feed ended before a worker frame")


async def keep_generating(http: aiohttp.ClientSession, url: str, model: str, streams: int) -> None:
    async def one():
        while True:
            body = {"model": model, "prompt": "Once upon a time", "max_tokens": 256, "ignore_eos": True}
            async with http.post(url + "/v1/completions", json=body) as resp:
                await resp.read()

    await asyncio.gather(*(one() for _ in range(streams)))


async def measure(url: str, model: str, repeat: int, streams: int) -> list[dict]:
    rows = []
    async with aiohttp.ClientSession() as http:
        for load in (0, streams):
            generating = asyncio.create_task(keep_generating(http, url, model, load)) if load else None
            cold, warm = [], []
            try:
                for _ in range(repeat):
                    await asyncio.sleep(STALE_S + WATCH_TTL_MS / 1000 + 1)  # nothing kept, nothing watched
                    cold.append(await first_worker_frame_ms(http, url))
                    warm.append(await first_worker_frame_ms(http, url))
            finally:
                if generating is not None:
                    generating.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await generating
            for kind, times in (("cold", cold), ("warm", warm)):
                rows.append({"opening": kind, "streams": load, "repeat": repeat, "median_ms": round(statistics.median(times), 1),
                             "max_ms": round(max(times), 1)})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="openings of each kind (a cold one waits ~14 s first)")
    ap.add_argument("--streams", type=int, default=16, help="requests generating during the loaded openings")
    args = ap.parse_args(argv)
    from pagedserve.stack import LocalStack

    with LocalStack(model="demo", workers=1) as stack:
        rows = asyncio.run(measure(stack.url, stack.served_model_name, args.repeat, args.streams))
    print(json.dumps({"bench": "dashboard_first_frame", "rows": rows}))
    print_table(rows, [("opening", lambda r: r["opening"]), ("streams", lambda r: r["streams"]),
                       ("median ms", lambda r: r["median_ms"]), ("max ms", lambda r: r["max_ms"])])


if __name__ == "__main__":
    main()
