"""Reading the KV dashboard's feed (``/dashboard/events``) in tests, and load that holds shared
blocks while it is read: parallel samples, beams, two requests on one system prompt."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from tests.service_helpers import MODEL_NAME

SYSTEM = list(range(300, 348))  # three full blocks of 16
LOAD = {  # prompt length -> body; the lengths tell the rows apart in a snapshot
    20: {"prompt": list(range(10, 30)), "n": 3, "temperature": 1.0, "seed": 1},
    21: {"prompt": list(range(40, 61)), "use_beam_search": True, "beam_width": 2, "n": 2, "temperature": 0.0},
    49: {"prompt": SYSTEM + [5], "temperature": 0.0},
    50: {"prompt": SYSTEM + [6, 7], "temperature": 0.0},
}


async def frames(feed: aiohttp.ClientResponse):
    """``(event, payload)`` of each SSE frame; keepalive comments skipped."""
    buffer = b""
    async for chunk in feed.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            raw, buffer = buffer.split(b"\n\n", 1)
            lines = dict(line.split(b": ", 1) for line in raw.split(b"\n") if not line.startswith(b":"))
            if b"data" in lines:
                yield lines[b"event"].decode(), json.loads(lines[b"data"])


async def hold_load(http: aiohttp.ClientSession, base: str, max_tokens: int = 400, headers=None) -> None:
    """Keep the load running: each request again as soon as it ends, until cancelled."""
    async def one(body, delay):
        await asyncio.sleep(delay)
        while True:
            payload = {"model": MODEL_NAME, "max_tokens": max_tokens, "ignore_eos": True, **body}
            async with http.post(base + "/v1/completions", json=payload, headers=headers) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()

    # The second request on the system prompt starts once the first has computed (and cached) it:
    # two prompts prefilled in the same step each compute their own blocks.
    await asyncio.gather(*(one(body, 0.5 if length == 50 else 0.0) for length, body in LOAD.items()))

