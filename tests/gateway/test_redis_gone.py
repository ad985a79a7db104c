"""Redis gone for good (killed, not restarted): every request held ends with an error a client can
act on within the outage grace and a few seconds, in each API's own shape, never at its deadline;
the worker aborts what it holds (every block back to the pool) and serves again once Redis is
back; a SIGTERM stops the gateway and the worker within their drain timeout whatever Redis does,
their exit codes saying requests were cut. A Redis back inside the grace loses nothing
(``tests/serve/test_worker_recovery.py``: the restarts under load)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import redis.asyncio as aioredis

from pagedserve.cli import stopped
from pagedserve.embedded_redis import RedisServer, free_port
from pagedserve.runtime.client import QueueClient
from pagedserve.runtime.outage import RedisGone
from pagedserve.runtime.supervision import EXIT_CUT
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.engine import Engine
from pagedserve.worker.setup.engine_config import EngineConfig
from tests.gateway_stack import Stack
from tests.serve.test_worker_recovery import start_worker_process, stream_is_clean, worker_engine
from tests.service_helpers import MODEL_NAME, apoll, collect, poll, running_worker, settings_for

GRACE_S = 2.0
SLACK_S = 8.0  # past the grace: the watch's second, the worker's retry back-off, a loaded CI machine
LONG = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0}  # the test model's context: none ends on its own here


async def stream_lines(http: httpx.AsyncClient, path: str, body: dict, first: asyncio.Event) -> tuple[list[str], float]:
    """The SSE data lines of a stream (``first`` set at its first), and when it ended."""
    lines = []
    async with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                first.set()
    return lines, time.monotonic()


async def whole(http: httpx.AsyncClient, path: str, body: dict) -> tuple[httpx.Response, float]:
    r = await http.post(path, json=body)
    return r, time.monotonic()


def test_requests_held_end_with_an_error_in_their_apis_shape_and_the_worker_frees_everything(zoo, tmp_path):
    server = RedisServer(tmp_path).start()
    engine = Engine(EngineConfig(model=str(zoo.path("llama-gqa")), device="cpu", dtype="float32", num_gpu_blocks=1024))
    stack = Stack(server, engine, zoo.path("llama-gqa"), worker_overrides={"outage_grace_s": GRACE_S}).start()
    url = stack.add_gateway(outage_grace_s=GRACE_S, max_tokens=2048)

    aborted = []

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            started = [asyncio.Event(), asyncio.Event()]
            held = [
                asyncio.create_task(stream_lines(http, "/v1/completions", {"model": MODEL_NAME, "prompt": "a", **LONG}, started[0])),
                asyncio.create_task(stream_lines(http, "/v1/responses", {"model": MODEL_NAME, "input": "b", "max_output_tokens": 2000,
                                                                         "temperature": 0}, started[1])),
                asyncio.create_task(whole(http, "/v1/chat/completions", {"model": MODEL_NAME, **LONG,
                                                                         "messages": [{"role": "user", "content": "c"}]})),
                asyncio.create_task(whole(http, "/v1/messages", {"model": MODEL_NAME, "max_tokens": 2000,
                                                                 "messages": [{"role": "user", "content": "d"}]})),
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            await asyncio.to_thread(poll, lambda: len(stack.worker.inflight) == 4, 30, "all four requests running")
            outbox = stack.worker.outbox  # what the worker aborts, and why: its outbox lets them go
            outbox.abort = lambda request_id, abort=outbox.abort: (aborted.append(request_id), abort(request_id))
            await asyncio.to_thread(server.stop)
            killed = time.monotonic()
            done = await asyncio.wait_for(asyncio.gather(*held), GRACE_S + SLACK_S + 5)
            return killed, done

    try:
        killed, (completion, response, chat, message) = asyncio.run(main())
        # Each ended within the grace and a little, with the error, not at the 60 s request timeout.
        for _, ended in (completion, response, chat, message):
            assert GRACE_S - 0.5 < ended - killed < GRACE_S + SLACK_S
        lines, _ = completion
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "redis_unavailable"
        assert json.loads(lines[0])["choices"][0]["text"] is not None  # tokens came before
        lines, _ = response
        assert json.loads(lines[-1])["type"] == "error" and json.loads(lines[-1])["code"] == "redis_unavailable"
        reply, _ = chat
        assert reply.status_code == 503 and reply.headers["Retry-After"] == "5"
        assert reply.json()["error"]["code"] == "redis_unavailable" and "unreachable" in reply.json()["error"]["message"]
        reply, _ = message
        assert reply.status_code == 503 and reply.json()["type"] == "error"
        assert reply.json()["error"]["type"] == "overloaded_error" and "unreachable" in reply.json()["error"]["message"]
        # The worker let go of all four (aborted, not finished): nothing held, every block back in the pool.
        poll(lambda: not stack.worker.inflight and engine.scheduler.blocks.usage().used == 0, 15,
             "the worker to abort what it held")
        assert len(aborted) >= 2 and any(r.startswith("cmpl-") for r in aborted)  # those with ignore_eos at least
        # Back (empty): the worker takes work again, the gateway answers.
        server.start()
        poll(lambda: httpx.get(url + "/ready").status_code == 200, 30, "the gateway to be ready again")
        again = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "e", "max_tokens": 3}, timeout=60)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 3
    finally:
        stack.stop()
        server.stop()


def test_entries_let_go_of_in_an_outage_are_acknowledged_once_redis_is_back(tmp_path, zoo):
    """Redis with an append-only file, down past the grace and then back: the queue producer's
    streams raised ``RedisGone``, the worker let go of both requests, and once Redis is back it
    acknowledges their entries (nobody runs them again: they would be reclaimed only after a
    minute here) and serves a new request."""
    server = RedisServer(tmp_path, durable=True).start()
    settings = settings_for(server.url, zoo.path("llama-gqa"), outage_grace_s=1.0, heartbeat_s=0.3, claim_idle_ms=60_000)
    long = SamplingParams(max_tokens=2000, ignore_eos=True)

    async def main():
        async with running_worker(settings, worker_engine(zoo)) as worker:
            async with QueueClient(server.url, outage_grace_s=1.0) as client:
                streams = [await client.submit(MODEL_NAME, prompt_token_ids=[30 + i] * 8, params=long) for i in range(2)]
                for stream in streams:
                    await stream.__anext__()
                await asyncio.to_thread(server.stop)
                raised = []
                for stream in streams:
                    try:
                        async for _ in stream:
                            pass
                    except RedisGone as gone:
                        raised.append(str(gone))
                await apoll(lambda: not worker.inflight, 15, "the worker to let go of both")
                await asyncio.to_thread(server.start)
                r = aioredis.from_url(server.url)
                await apoll(lambda: stream_is_clean(r), 30, "their entries acknowledged")
                await r.aclose()
                again = await collect(await client.submit(MODEL_NAME, prompt_token_ids=[5] * 4,
                                                          params=SamplingParams(max_tokens=3, ignore_eos=True)))
        return raised, again

    try:
        raised, again = asyncio.run(main())
    finally:
        server.stop()
    assert len(raised) == 2 and all("unreachable" in message for message in raised)
    assert again.last.finish_reason == "length" and len(again.tokens()) == 3


def start_gateway_process(redis_url: str, model_path, port: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedserve.gateway", "--model", str(model_path), "--served-model-name", MODEL_NAME,
           "--redis-url", redis_url, "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    proc.log = []
    threading.Thread(target=lambda: proc.log.extend(proc.stderr), daemon=True).start()
    return proc


def test_sigterm_stops_the_gateway_and_the_worker_within_their_drain_timeout_with_redis_gone(zoo, tmp_path):
    """Two streams in flight, Redis killed, the short one ending in the worker meanwhile (its last
    events cannot go out): both processes stop within their drain timeout, cutting both (``EXIT_CUT``),
    the clients told why. (With Redis up the worker drains: test_worker_recovery.py.)"""
    drain = 4.0
    server = RedisServer(tmp_path).start()
    port = free_port()
    worker = start_worker_process(server.url, zoo.path("llama-gqa"), "stopper", "--drain-timeout", str(drain))
    gateway = start_gateway_process(server.url, zoo.path("llama-gqa"), port, "--drain-timeout", str(drain))
    url = f"http://127.0.0.1:{port}"
    try:
        poll(lambda: _ready(url), 90, "the gateway and the worker to be ready")

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                firsts = [asyncio.Event(), asyncio.Event()]
                tasks = [asyncio.create_task(stream_lines(http, "/v1/completions", {"model": MODEL_NAME, "prompt": "a",
                                                                                    **LONG, "max_tokens": tokens}, first))
                         for tokens, first in zip((2000, 100), firsts)]
                await asyncio.wait_for(asyncio.gather(*(first.wait() for first in firsts)), 60)
                await asyncio.to_thread(server.stop)
                await asyncio.sleep(2.0)  # the short one ends meanwhile: its last events wait in the outbox
                stopping = time.monotonic()
                worker.send_signal(signal.SIGTERM)
                gateway.send_signal(signal.SIGTERM)
                codes = await asyncio.gather(*(asyncio.to_thread(p.wait, drain + SLACK_S + 10) for p in (worker, gateway)))
                took = time.monotonic() - stopping
                return codes, took, [lines for lines, _ in await asyncio.wait_for(asyncio.gather(*tasks), 10)]

        (worker_code, gateway_code), took, streams = asyncio.run(main())
    finally:
        for proc in (worker, gateway):
            proc.kill()
            proc.wait()
        server.stop()
    assert took < drain + SLACK_S, f"stopping took {took:.1f} s"
    assert (worker_code, gateway_code) == (EXIT_CUT, EXIT_CUT), (worker.log[-5:], gateway.log[-5:])
    for lines in streams:
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "redis_unavailable"


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_stopped_stacks_exit_code_says_what_happened():
    assert stopped({"gateway": 0, "worker w0": 0}) == 0
    assert stopped({"gateway": 0, "worker w0": EXIT_CUT}) == EXIT_CUT  # stopped on time, requests cut
    assert stopped({"gateway": 0, "worker w0": -9}) == 1  # killed: it did not stop on its own
    assert stopped({"gateway": EXIT_CUT, "worker w0": 1}) == 1
