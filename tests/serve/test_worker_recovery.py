"""Failures: dead workers (entries reclaimed, rerun, or ended with an error), SIGTERM drain,
and a Redis restart under load. Workers run as real processes where the failure is a process's."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time

import redis.asyncio as aioredis

from shared.client import QueueClient
from shared.keys import Keys
from shared.protocol import ReplyTarget, WireRequest
from shared.sampling import SamplingParams
from pagedserve.embedded_redis import RedisServer
from tests.service_helpers import MODEL_NAME, apoll, collect, running_worker, settings_for
from pagedserve import LLM
from worker.engine import Engine
from worker.core.engine_config import EngineConfig

KEYS = Keys()


def start_worker_process(url: str, model_path, consumer: str, *extra: str) -> subprocess.Popen:
    """A worker process whose log lines collect in ``proc.log`` (read by a thread, so a full pipe never blocks it)."""
    cmd = [sys.executable, "-m", "worker", "--model", str(model_path), "--redis-url", url, "--served-model-name",
           MODEL_NAME, "--consumer", consumer, "--claim-idle-ms", "1500", "--heartbeat", "0.3",
           "--num-gpu-blocks", "512", "--dtype", "float32", "--device", "cpu", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    proc.log = []
    threading.Thread(target=lambda: proc.log.extend(proc.stderr), daemon=True).start()
    return proc


async def wait_alive(r, consumer: str, timeout: float = 60) -> None:
    await apoll(lambda: r.exists(KEYS.alive(MODEL_NAME, consumer)), timeout, f"worker {consumer} to come up")


async def stream_is_clean(r) -> bool:
    pending = await r.xpending(KEYS.requests(MODEL_NAME), KEYS.group(MODEL_NAME))
    return pending["pending"] == 0 and await r.xlen(KEYS.requests(MODEL_NAME)) == 0


def test_sigkill_mid_run_every_request_completes_or_errors(redis_server, zoo):
    """With the default heartbeat (1 s) and idle limit (30 s): the dead worker is noticed from its
    missing heartbeats, and its requests end within 5 s of the kill, not after 30 s of idle time."""
    path = zoo.path("llama-gqa")
    defaults = ("--claim-idle-ms", "30000", "--heartbeat", "1.0")

    async def main():
        r = aioredis.from_url(redis_server.url)
        workers = {name: start_worker_process(redis_server.url, path, name, "--max-inflight", "6", *defaults)
                   for name in ("w1", "w2")}
        try:
            for name in workers:
                await wait_alive(r, name)
            async with QueueClient(redis_server.url) as client:
                params = SamplingParams(max_tokens=1500, ignore_eos=True)  # long enough to be killed mid-run
                streams = [await client.submit(MODEL_NAME, prompt_token_ids=[30 + i] * 20, params=params) for i in range(12)]
                started: set[str] = set()
                ended: dict[str, float] = {}

                async def note(event) -> None:
                    started.add(event.id)
                    if event.done:
                        ended[event.id] = time.monotonic()

                tasks = [asyncio.create_task(collect(s, note)) for s in streams]
                # 2 workers x 6 in flight: every request is streaming before one worker dies
                await apoll(lambda: len(started) == 12, 60, "all twelve requests to stream")
                owners = await r.xpending_range(KEYS.requests(MODEL_NAME), KEYS.group(MODEL_NAME), "-", "+", 100)
                victim = max(workers, key=lambda w: sum(o["consumer"].decode() == w for o in owners))
                workers[victim].send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
                results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            await apoll(lambda: stream_is_clean(r), 10, "the dead worker's entries to be acknowledged")
            recovery = max(ended[got.last.id] - killed_at for got in results if got.last.finish_reason == "error")
            return results, await stream_is_clean(r), recovery
        finally:
            for proc in workers.values():
                proc.kill()
                proc.wait()
            await r.aclose()

    results, clean, recovery = asyncio.run(main())
    outcomes = [(got.last.finish_reason, got.last.error) for got in results]
    assert all(got.last.done for got in results)
    assert all(reason == "length" or (reason == "error" and "died" in error) for reason, error in outcomes), outcomes
    assert any(reason == "error" for reason, _ in outcomes), "the killed worker held no request"
    assert clean, "entries of the dead worker were neither acknowledged nor dead-lettered"
    assert recovery <= 5.0, f"the dead worker's requests ended {recovery:.1f} s after the kill"


def test_sigterm_drains_in_flight_work_and_exits_zero(redis_server, zoo):
    async def main():
        r = aioredis.from_url(redis_server.url)
        proc = start_worker_process(redis_server.url, zoo.path("llama-gqa"), "drainer")
        try:
            await wait_alive(r, "drainer")
            async with QueueClient(redis_server.url) as client:
                params = SamplingParams(max_tokens=400, ignore_eos=True)
                streams = [await client.submit(MODEL_NAME, prompt_token_ids=[40 + i] * 10, params=params) for i in range(8)]
                firsts = [await s.__anext__() for s in streams]  # all eight are in flight
                proc.send_signal(signal.SIGTERM)
                await apoll(lambda: any("draining" in line for line in proc.log), 30, "the worker to start draining")
                await client.submit(MODEL_NAME, prompt="late", params=params)  # must wait for another worker
                results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 120)
            code = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 60)
            pending = await r.xpending(KEYS.requests(MODEL_NAME), KEYS.group(MODEL_NAME))
            return (firsts, results, code, pending["pending"], await r.xlen(KEYS.requests(MODEL_NAME)),
                    await r.exists(KEYS.alive(MODEL_NAME, "drainer")))
        finally:
            proc.kill()
            proc.wait()
            await r.aclose()

    firsts, results, code, pending, queued, alive = asyncio.run(main())
    assert all(e.seq == 0 for e in firsts)
    assert code == 0
    assert all(got.last.finish_reason == "length" and len(got.tokens()) + len(f.outputs[0].token_ids) == 400
               for got, f in zip(results, firsts))
    assert pending == 0 and queued == 1 and not alive  # the late request was left for another worker


def test_entries_of_a_worker_that_died_before_streaming_are_rerun_or_dead_lettered(redis_server, zoo):
    engine = Engine(EngineConfig(model=str(zoo.path("llama-gqa")), device="cpu", dtype="float32", num_gpu_blocks=256))

    async def main():
        r = aioredis.from_url(redis_server.url)
        stream, group = KEYS.requests(MODEL_NAME), KEYS.group(MODEL_NAME)
        await r.xgroup_create(stream, group, id="0", mkstream=True)
        async with QueueClient(redis_server.url) as client:
            reply = ReplyTarget("channel", client.dispatcher.channel)
            boxes = {rid: client.dispatcher.open(rid) for rid in ("orphan", "poison")}
            for rid in boxes:
                req = WireRequest(id=rid, model=MODEL_NAME, params=SamplingParams(max_tokens=5, temperature=0.0), reply=reply,
                                  prompt_token_ids=[7, 8, 9])
                await r.xadd(stream, {"data": req.encode()})
            ghost = await r.xreadgroup(group, "ghost", {stream: ">"}, count=2)  # a worker that read and died
            poison_id = ghost[0][1][1][0]
            for i in range(3):  # delivered again and again: a request that kills every worker
                await r.xclaim(stream, group, f"ghost-{i}", 0, [poison_id])

            async def idle_enough() -> bool:  # past the claim_idle_ms=200 of the worker below
                entries = await r.xpending_range(stream, group, "-", "+", 10)
                return len(entries) == 2 and all(e["time_since_delivered"] >= 250 for e in entries)

            await apoll(idle_enough, 10, "the dead worker's entries to idle past the claim limit")
            async with running_worker(settings_for(redis_server.url, zoo.path("llama-gqa"), claim_idle_ms=200), engine):
                results = {rid: [e async for e in box.events()] for rid, box in boxes.items()}
            dead = await r.xrange(KEYS.dead_letter(MODEL_NAME))
            clean = await stream_is_clean(r)
        await r.aclose()
        return results, dead, clean

    results, dead, clean = asyncio.run(main())
    assert results["orphan"][-1].finish_reason == "length" and len(results["orphan"]) >= 2
    assert results["poison"][-1].finish_reason == "error" and "deliveries" in results["poison"][-1].error
    assert len(dead) == 1 and b"deliveries" in dead[0][1][b"reason"]
    assert clean


def test_redis_restart_under_load_loses_nothing(tmp_path, zoo):
    server = RedisServer(tmp_path, durable=True).start()
    cases = [([50 + i] * (5 + i), 1000) for i in range(6)]
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=256)
    expected = [o.outputs[0].token_ids for o in llm.generate(
        [p for p, _ in cases], [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in cases], use_tqdm=False)]
    engine = Engine(EngineConfig(model=str(zoo.path("llama-gqa")), device="cpu", dtype="float32", num_gpu_blocks=256))

    async def main():
        async with running_worker(settings_for(server.url, zoo.path("llama-gqa")), engine):
            async with QueueClient(server.url) as client:
                streams = [await client.submit(MODEL_NAME, prompt_token_ids=p, durable=True,
                                               params=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
                           for p, n in cases]
                seen = []

                async def count(event):
                    seen.append(event)

                tasks = [asyncio.create_task(collect(s, count)) for s in streams]
                await apoll(lambda: len(seen) >= 12, 60, "a dozen events before Redis goes away", interval=0.01)
                server.stop()  # under load: the engine keeps generating while Redis is gone
                at_stop = sum(e.done for e in seen)
                await asyncio.sleep(1.0)  # the fault: Redis stays down for a second
                server.start()
                return await asyncio.wait_for(asyncio.gather(*tasks), 120), at_stop

    try:
        results, done_at_stop = asyncio.run(main())
    finally:
        server.stop()
    assert done_at_stop == 0, "the requests were meant to be mid-generation when Redis went away"
    for got, want in zip(results, expected):
        assert [e.seq for e in got.events] == list(range(len(got.events)))
        assert got.tokens() == want and got.last.finish_reason == "length"

