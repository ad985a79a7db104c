"""``create_app(settings)``: the aiohttp application, its state (``web.AppKey``), middlewares and routes."""

from __future__ import annotations

import asyncio
import hmac
import time

import structlog
from aiohttp import web
from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError

from pagedserve.gateway.bodies.parse import ApiError
from pagedserve.gateway.http.api_error import REFUSAL, note_refusal
from pagedserve.gateway.http.sse import CLIENT_GONE
from pagedserve.gateway.routes import lora as lora_api
from pagedserve.gateway.routes import responses as responses_api
from pagedserve.gateway.routes.anthropic import error_body as anthropic_error_body, messages
from pagedserve.gateway.routes.dashboard import ASSETS, dashboard_asset, dashboard_events
from pagedserve.gateway.routes.docs import DOCS_ASSETS, docs, docs_asset
from pagedserve.gateway.routes.embeddings import embeddings
from pagedserve.gateway.routes.openai import chat_completions, completions
from pagedserve.gateway.routes.utility import detokenize, models, tokenize, version
from pagedserve.gateway.service.generation import STATE, TALLY
from pagedserve.gateway.service.instance import GatewayService
from pagedserve.gateway.service.settings import GatewaySettings

log = structlog.get_logger("pagedserve.gateway")
OPEN_PATHS = {"/health", "/ready", "/metrics", "/openapi.json", "/version", "/docs", *ASSETS, *DOCS_ASSETS}  # /dashboard/events: keyed
QUIET_PATHS = {"/health", "/ready", "/metrics"}
ANTHROPIC_PATH = "/v1/messages"  # its errors are in Anthropic's shape


def create_app(settings: GatewaySettings) -> web.Application:
    app = web.Application(client_max_size=settings.max_body_bytes,
                          middlewares=[_access_log, _errors, _cors(settings), _auth(settings)])
    app[STATE] = GatewayService(settings)
    app.on_startup.append(_start)
    app.on_shutdown.append(_end_feeds)
    app.on_cleanup.append(_stop)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post(ANTHROPIC_PATH, messages)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/responses", responses_api.create)
    app.router.add_get("/v1/responses/{response_id}", responses_api.retrieve)
    app.router.add_delete("/v1/responses/{response_id}", responses_api.delete)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/load_lora_adapter", lora_api.load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", lora_api.unload_lora_adapter)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_get("/docs", docs)
    for path in DOCS_ASSETS:
        app.router.add_get(path, docs_asset)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    for path in ASSETS:
        app.router.add_get(path, dashboard_asset)
    app.router.add_get("/dashboard/events", dashboard_events)
    return app


async def _start(app: web.Application) -> None:
    await app[STATE].start()


async def _end_feeds(app: web.Application) -> None:
    """Before connections close: long-lived dashboard feeds end, so shutdown does not wait on them;
    the requests held are waited for (``--drain-timeout``) unless Redis is unreachable, when they
    end at once with a 503 (nothing can come for them)."""
    state = app[STATE]
    state.dispatcher.drain()
    await state.dashboard.close()


async def _stop(app: web.Application) -> None:
    await app[STATE].close()


def _error_response(err: ApiError, path: str) -> web.Response:
    body = anthropic_error_body(err) if path == ANTHROPIC_PATH else err.body()
    return web.json_response(body, status=err.status, headers=err.headers)


@web.middleware
async def _access_log(request: web.Request, handler):
    """One line per request: method, path, status, latency, tokens; the reason of a 4xx/5xx. Probes
    (/health, /ready, /metrics) are not logged: they would drown the rest."""
    started = time.monotonic()
    try:
        response = await handler(request)
    except asyncio.CancelledError:  # the client went away (handler cancellation)
        log.info("http", method=request.method, path=request.path, status="client gone",
                 ms=round((time.monotonic() - started) * 1000, 1))
        raise
    if request.path not in QUIET_PATHS:
        tally = request.get(TALLY)
        fields = {"method": request.method, "path": request.path, "status": response.status,
                  "ms": round((time.monotonic() - started) * 1000, 1)}
        if tally is not None:
            fields.update(prompt_tokens=tally.prompt_tokens, completion_tokens=tally.completion_tokens)
        if request.get(REFUSAL):
            fields["error"] = request[REFUSAL]
        if request.get(CLIENT_GONE):
            fields["status"] = "client gone"
        (log.warning if response.status >= 400 or request.get(REFUSAL) else log.info)("http", **fields)
    return response


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as err:
        note_refusal(request, err)
        return _error_response(err, request.path)
    except (RedisConnectionError, RedisTimeoutError) as err:
        log.warning("redis unavailable", path=request.path, error=str(err))
        return _error_response(ApiError(503, "the queue is unreachable; retry shortly", None, "redis_unavailable",
                                        "service_unavailable", {"Retry-After": "2"}), request.path)
    except web.HTTPException as err:
        if err.status < 400:
            raise
        kind = "invalid_request_error" if err.status < 500 else "server_error"
        return _error_response(ApiError(err.status, err.reason or "error", type_=kind, headers={
            k: v for k, v in err.headers.items() if k.lower() == "allow"}), request.path)
    except Exception:  # a bug: log it, answer in OpenAI's shape, keep serving
        log.exception("unhandled error", path=request.path)
        return _error_response(ApiError(500, "internal server error", type_="server_error"), request.path)


def _auth(settings: GatewaySettings):
    keys = [k.encode() for k in settings.api_keys]

    @web.middleware
    async def check(request: web.Request, handler):
        if keys and request.path not in OPEN_PATHS and request.method != "OPTIONS":
            # surrogateescape: a header with non-ASCII bytes is a wrong key (401), not a crash
            # Anthropic's clients send the key as x-api-key
            sent = request.headers.get("x-api-key") or request.headers.get("Authorization", "").removeprefix("Bearer ")
            given = sent.strip().encode(errors="surrogateescape")
            if not any(hmac.compare_digest(given, k) for k in keys):
                raise ApiError(401, "invalid or missing API key", None, "invalid_api_key", "authentication_error")
        return await handler(request)

    return check


def _cors(settings: GatewaySettings):
    origins = set(settings.cors_origins)

    @web.middleware
    async def cors(request: web.Request, handler):
        origin = request.headers.get("Origin")
        allowed = origin if origin and ("*" in origins or origin in origins) else None
        if request.method == "OPTIONS" and allowed:
            response = web.Response(status=204)
        else:
            response = await handler(request)
        if allowed:
            response.headers.update({"Access-Control-Allow-Origin": allowed, "Access-Control-Allow-Headers": "Authorization, Content-Type, x-api-key, anthropic-version",
                                     "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS"})
        return response

    return cors


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        await state.redis.ping()
    except Exception as err:  # any failure to reach Redis means not ready
        return web.json_response({"status": "redis unreachable", "error": str(err)}, status=503)
    if not await state.serving():
        return web.json_response({"status": "no live worker"}, status=503)
    return web.json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    body = await request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].openapi)
