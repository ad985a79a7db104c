"""``GET /dashboard``: the KV dashboard page (static files in ``gateway/static``, no build step, no
CDN), and ``GET /dashboard/events``: its live feed as server-sent events (``gateway/dashboard/hub.py``).

The page and its script are open (they hold no data); the feed follows the API-key rule of the
API. The page reads the feed with ``fetch`` (not ``EventSource``, which cannot send a header), so
the key travels as ``Authorization: Bearer``, never in a URL.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

from pagedserve.gateway.bodies.parse import ApiError
from pagedserve.gateway.http import sse
from pagedserve.runtime.queue_wait import MISSING, get_within
from pagedserve.gateway.service.generation import STATE

STATIC = Path(__file__).parents[1] / "static"  # gateway/static
ASSETS = {"/dashboard": ("dashboard.html", "text/html"), "/dashboard/app.js": ("dashboard.js", "text/javascript"),
          "/dashboard/draw.js": ("draw.js", "text/javascript"), "/dashboard/app.css": ("dashboard.css", "text/css")}
KEEPALIVE_S = 15.0  # a comment line this often, so proxies keep an idle feed open


async def dashboard_asset(request: web.Request) -> web.Response:
    name, kind = ASSETS[request.path]
    return web.Response(body=(STATIC / name).read_bytes(), content_type=kind, charset="utf-8",
                        headers={"Cache-Control": "no-cache"})


async def dashboard_events(request: web.Request) -> web.StreamResponse:
    hub = request.app[STATE].dashboard
    if hub.full:
        raise ApiError(503, f"{hub.max_viewers} dashboards are open on this gateway already; retry later", None,
                       "too_many_dashboards", "service_unavailable", {"Retry-After": "10"})
    async with hub.viewer() as frames:
        response = await sse.open_stream(request)
        return await sse.until_client_gone(request, response, _feed(response, frames))


async def _feed(response: web.StreamResponse, frames: asyncio.Queue) -> None:
    while True:
        frame = await get_within(frames, KEEPALIVE_S)  # a cancel (the viewer gone) propagates
        if frame is MISSING:
            frame = b": keepalive\n\n"
        if frame is None:  # the gateway is closing
            return
        await response.write(frame)
