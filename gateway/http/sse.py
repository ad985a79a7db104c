"""Server-sent events, framed the way OpenAI clients parse them: ``data: <json>\\n\\n``, ending with
``data: [DONE]\\n\\n``; a named event (the KV dashboard's feed) adds its ``event:`` line."""

from __future__ import annotations

import json
from typing import Awaitable

from aiohttp import web

DONE = b"data: [DONE]\n\n"
CLIENT_GONE = web.RequestKey("client_gone", bool)  # set when a stream's client left while it was written


def frame(obj: dict, event: str | None = None) -> bytes:
    named = f"event: {event}\n".encode() if event else b""
    return named + b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
        "Connection": "keep-alive", "X-Accel-Buffering": "no",
    })
    await response.prepare(request)
    return response


async def until_client_gone(request: web.Request, response: web.StreamResponse, writes: Awaitable[None]) -> web.StreamResponse:
    """Await ``writes`` (a stream's writes to ``response``): a client that goes away while they are
    written ends the stream quietly (the access log says so), not as a 500 with a traceback."""
    try:
        await writes
    except ConnectionResetError:
        request[CLIENT_GONE] = True
    return response
