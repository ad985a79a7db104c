"""The worker service through a real redis-server, with the real engine on a small model."""

from __future__ import annotations

import asyncio
import re

import msgpack
import pytest
import redis.asyncio as aioredis

from pagedserve import LLM
from pagedserve.runtime.client import QueueClient
from pagedserve.runtime.redis_client import connect
from pagedserve.shared.keys import Keys
from pagedserve.shared.protocol import VERSION, pack
from pagedserve.shared.sampling import SamplingParams
from pagedserve.shared.worker_info import WorkerInfo
from pagedserve.worker.engine import Engine
from pagedserve.worker.setup.engine_config import EngineConfig
from tests.conftest import random_prompts
from tests.service_helpers import MODEL_NAME, ChannelTap, apoll, collect, events_of, running_worker, settings_for


@pytest.fixture(scope="module")
def engine(zoo):
    return Engine(EngineConfig(model=str(zoo.path("llama-gqa")), device="cpu", dtype="float32", num_gpu_blocks=1024, max_num_seqs=64))


def offline(zoo, cases):
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=1024)
    outs = llm.generate([p for p, _ in cases], [SamplingParams(temperature=0.0, max_tokens=n) for _, n in cases],
                        use_tqdm=False)
    return [o.outputs[0] for o in outs]


def test_fifty_concurrent_requests_arrive_complete_in_order_and_match_offline(redis_url, zoo, engine):
    cases = random_prompts(seed=11, count=50, max_len=60, vocab=512, max_new=30)
    expected = offline(zoo, cases)

    async def main():
        async with running_worker(settings_for(redis_url, zoo.path("llama-gqa")), engine):
            async with QueueClient(redis_url) as client:
                streams = [await client.submit(MODEL_NAME, prompt_token_ids=p, params=SamplingParams(temperature=0.0, max_tokens=n))
                           for p, n in cases]
                return await asyncio.gather(*(collect(s) for s in streams))

    results = asyncio.run(main())
    for got, want in zip(results, expected):
        assert [e.seq for e in got.events] == list(range(len(got.events)))  # every event once, in order
        assert sum(e.done for e in got.events) == 1 and got.last.done
        assert got.last.finish_reason == want.finish_reason and got.last.error is None
        assert got.tokens() == want.token_ids and got.text() == want.text
        assert got.last.usage["completion_tokens"] == len(want.token_ids)
    assert engine.scheduler.blocks.usage().used == 0


def test_malformed_entries_are_dead_lettered_and_the_worker_keeps_serving(redis_url, zoo, engine):
    keys = Keys()

    async def main():
        r = connect(redis_url)
        async with running_worker(settings_for(redis_url, zoo.path("llama-gqa")), engine):
            async with QueueClient(redis_url) as client:
                channel = client.dispatcher.channel
                box = client.dispatcher.open("bad-params")
                stream = keys.requests(MODEL_NAME)
                await r.xadd(stream, {"data": b"\xc1 not msgpack"})
                await r.xadd(stream, {"data": pack({"v": 99, "id": "x"})})
                await r.xadd(stream, {"other": b"no data field"})
                await r.xadd(stream, {"data": pack({"v": VERSION, "id": "bad-params", "model": MODEL_NAME, "prompt": "hi",
                                                    "params": {"temperature": -1}, "reply": {"channel": channel}})})
                alive = keys.alive(MODEL_NAME, "test-worker")
                for fields in ({"prompt": None, "messages": []}, {"params": {"stop_token_ids": 5}}, {"params": {1: 2}},
                               {"reply": {"channel": alive}}, {"reply": {"stream": alive}}):
                    await r.xadd(stream, {"data": pack({"v": VERSION, "id": "poison", "model": MODEL_NAME, "prompt": "hi",
                                                        "reply": {"channel": channel}, **fields})})
                error = await events_of(box)
                ok = await collect(await client.submit(MODEL_NAME, prompt="still alive?", params=SamplingParams(max_tokens=3)))

                async def dead_letters_reported() -> bool:  # the worker's heartbeat reads the stream's length
                    value = await r.hget(keys.metrics(MODEL_NAME, "test-worker"), "dead_letters")
                    return value is not None and float(value) == 9

                await apoll(dead_letters_reported, 10, "the nine dead letters in the worker's metrics")
            dead = await r.xrange(keys.dead_letter(MODEL_NAME))
            pending = await r.xpending(stream, keys.group(MODEL_NAME))
        await r.aclose()
        return error, ok, dead, pending

    error, ok, dead, pending = asyncio.run(main())
    assert error[-1].done and error[-1].finish_reason == "error" and "temperature" in error[-1].error
    assert ok.last.done and ok.last.error is None
    reasons = [fields[b"reason"].decode() for _, fields in dead]
    assert len(reasons) == 9, reasons
    assert any("malformed msgpack" in r for r in reasons) and any("version 99" in r for r in reasons)
    assert sum("outside pagedserve:replies:*" in r for r in reasons) == 2
    assert any("messages" in r for r in reasons) and any("stop_token_ids" in r for r in reasons)
    assert pending["pending"] == 0


def test_cancel_storm_frees_every_block(redis_url, zoo, engine):
    async def main():
        async with running_worker(settings_for(redis_url, zoo.path("llama-gqa")), engine):
            async with QueueClient(redis_url) as client:
                params = SamplingParams(max_tokens=400, ignore_eos=True)
                ids = [f"storm-{i}" for i in range(20)]
                streams = [await client.submit(MODEL_NAME, prompt_token_ids=[20 + i] * 30, params=params, request_id=rid)
                           for i, rid in enumerate(ids)]

                async def cancel_half(event):
                    if event.seq == 2 and int(event.id.split("-")[1]) % 2 == 0:
                        await client.cancel(MODEL_NAME, event.id)

                results = await asyncio.gather(*(collect(s, cancel_half) for s in streams))
        return results

    results = asyncio.run(main())
    for i, got in enumerate(results):
        assert got.last.done
        assert got.last.finish_reason == ("abort" if i % 2 == 0 else "length")
    assert engine.scheduler.blocks.usage().used == 0


def test_client_leaving_early_cancels_the_request(redis_server, zoo, engine):
    """Only the cancel can end this request early: 1,000 tokens would take seconds, and the worker's
    last event on the wire must be an abort after a handful of tokens."""
    async def main():
        tap = await ChannelTap(redis_server.url, "pagedserve:cancel:*", "pagedserve:replies:*").start()
        async with running_worker(settings_for(redis_server.url, zoo.path("llama-gqa")), engine) as service:
            async with QueueClient(redis_server.url) as client:
                stream = await client.submit(MODEL_NAME, prompt="go", params=SamplingParams(max_tokens=1000, ignore_eos=True),
                                             request_id="leaver")
                async for event in stream:
                    if event.seq == 3:
                        break
                await stream.aclose()
                await apoll(lambda: not service.inflight, 10, "the worker to drop the request")
                await apoll(lambda: any(e.done for e in tap.events("leaver")), 10, "the terminal event")
        await tap.stop()
        return tap

    tap = asyncio.run(main())
    assert [(c.id, c.reason) for c in tap.cancels()] == [("leaver", "client gone")]
    events = tap.events("leaver")
    assert events[-1].finish_reason == "abort"
    assert sum(len(o.token_ids) for e in events for o in e.outputs) < 500
    assert engine.scheduler.blocks.usage().used == 0


def test_wire_format_is_plain_msgpack(redis_server, zoo, engine):
    """What a producer in another language sees: maps of plain types with a version field."""
    async def main():
        r = aioredis.from_url(redis_server.url)
        pubsub = r.pubsub()
        await pubsub.subscribe("pagedserve:replies:my-replies")
        async with running_worker(settings_for(redis_server.url, zoo.path("llama-gqa")), engine):
            await r.xadd(Keys().requests(MODEL_NAME), {"data": msgpack.packb({
                "v": 1, "id": "raw-1", "model": MODEL_NAME, "prompt_token_ids": [5, 6, 7],
                "params": {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True, "logprobs": 2},
                "reply": {"channel": "pagedserve:replies:my-replies"},
            })})
            events = []

            async def read_one() -> bool:
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
                if msg:
                    events.extend(msgpack.unpackb(msg["data"], strict_map_key=False))
                return bool(events and events[-1]["done"])

            await apoll(read_one, 30, "the raw request's terminal event", interval=0)
            info = WorkerInfo.decode(await r.get(Keys().worker_info(MODEL_NAME, "test-worker")))
        await pubsub.aclose()
        await r.aclose()
        return events, info

    events, info = asyncio.run(main())
    # What the gateways route and admit by, published with the heartbeat (shared/worker_info.py).
    assert (info.model, info.max_model_len, info.vocab_size, info.block_size) == (
        MODEL_NAME, engine.limits()["max_model_len"], engine.limits()["vocab_size"], 16)
    # Logprobs carry each token's text, so a reader needs no tokenizer.
    entries = [lp for e in events for o in e["outputs"] for lp in o["logprobs"] or []]
    assert len(entries) == 2
    for lp in entries:
        assert lp["token"] == engine.tokenizer.decode([lp["token_id"]])
        assert set(lp["top_tokens"]) == set(lp["top"]) and len(lp["top"]) >= 2
        assert all(text == engine.tokenizer.decode([i]) for i, text in lp["top_tokens"].items())
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert events[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 0}
    assert all(e["v"] == 1 and e["id"] == "raw-1" for e in events)


def test_worker_metrics_reach_redis_and_prometheus(redis_server, zoo, engine):
    import urllib.request

    from pagedserve.embedded_redis import free_port  # noqa: PLC0415

    port = free_port()

    async def main():
        r = aioredis.from_url(redis_server.url)
        settings = settings_for(redis_server.url, zoo.path("llama-gqa"), metrics_port=port, consumer="metered")
        async with running_worker(settings, engine):
            async with QueueClient(redis_server.url) as client:
                await collect(await client.submit(MODEL_NAME, prompt="x", params=SamplingParams(max_tokens=2)))

            async def reported() -> bool:  # a heartbeat after the request carries its tokens
                return (await r.hget(Keys().metrics(MODEL_NAME, "metered"), "generation_tokens_total")) == b"2"

            await apoll(reported, 10, "a heartbeat with the request's tokens")
            stored = await r.hgetall(Keys().metrics(MODEL_NAME, "metered"))
            text = await asyncio.get_running_loop().run_in_executor(
                None, lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
        await r.aclose()
        return stored, text

    stored, text = asyncio.run(main())
    assert {b"kv_cache_usage_perc", b"num_requests_running", b"queue_depth", b"generation_tokens_per_s"} <= set(stored)
    assert int(stored[b"generation_tokens_total"]) == 2
    assert 'vllm:num_requests_running{model_name="tiny"}' in text and "# TYPE vllm:num_preemptions_total counter" in text
    per_token = engine.limits()["kv_bytes_per_token"]
    assert (f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",kv_bytes_per_token="{per_token}",'
            'model_name="tiny"} 1.0') in text


def test_two_live_workers_cannot_share_a_consumer_name(redis_server, zoo, engine):
    from pagedserve.worker.serve.bridge import ConsumerNameTaken
    from pagedserve.worker.serve.service import WorkerService

    async def main():
        settings = settings_for(redis_server.url, zoo.path("llama-gqa"), consumer="same-name")
        async with running_worker(settings, engine) as first:
            await apoll(lambda: first.redis.exists(first.keys.alive(MODEL_NAME, "same-name")), 10, "the first worker's name")
            with pytest.raises(ConsumerNameTaken, match="same-name"):
                await WorkerService(settings, engine).run()
        # once the first one is gone, the name is free again
        async with running_worker(settings, engine):
            pass

    asyncio.run(main())


def test_a_task_that_fails_is_restarted_and_heartbeats_go_on(redis_server, zoo, engine):
    """A fault inside the heartbeat (replaced for one call: a mock for a failure Redis would not
    produce on demand) is logged and the maintenance task restarts; the worker stays alive."""
    async def main():
        async with running_worker(settings_for(redis_server.url, zoo.path("llama-gqa")), engine) as service:
            real, calls = service.bridge.heartbeat, []

            async def flaky(*args, **kwargs):
                calls.append(1)
                if len(calls) == 1:
                    raise RuntimeError("injected heartbeat fault")
                return await real(*args, **kwargs)

            service.bridge.heartbeat = flaky
            await apoll(lambda: len(calls) >= 4, 10, "heartbeats after the fault")
            async with QueueClient(redis_server.url) as client:
                done = await collect(await client.submit(MODEL_NAME, prompt="x", params=SamplingParams(max_tokens=2)))
            return service.exit_code, done

    code, done = asyncio.run(main())
    assert code == 0 and done.last.finish_reason == "length"


def test_queue_producers_ask_for_structured_output_in_params(redis_server, zoo, engine):
    """``params.structured`` on the wire (docs/protocol.md): a valid constraint is followed, a bad
    one is an error event naming it, and the worker goes on."""
    from pagedserve.shared.structured import StructuredOutputs

    regex = r"[a-f]{3}:[0-9]{2}"

    async def main():
        async with running_worker(settings_for(redis_server.url, zoo.path("llama-gqa")), engine):
            async with QueueClient(redis_server.url) as client:
                good = [await client.submit(MODEL_NAME, prompt=f"p{i}", params=SamplingParams(
                    max_tokens=40, temperature=1.0, seed=i, structured=StructuredOutputs(regex=regex))) for i in range(10)]
                good = await asyncio.gather(*(collect(s) for s in good))
                r = aioredis.from_url(redis_server.url)
                box = client.dispatcher.open("bad-structured")
                await r.xadd(Keys().requests(MODEL_NAME), {"data": pack({
                    "v": VERSION, "id": "bad-structured", "model": MODEL_NAME, "prompt": "hi",
                    "params": {"structured": {"regex": "(open"}}, "reply": {"channel": client.dispatcher.channel}})})
                bad = await events_of(box)
                await r.aclose()
        return good, bad

    good, bad = asyncio.run(main())
    assert all(g.last.finish_reason == "stop" and re.fullmatch(regex, g.text()) for g in good)
    assert bad[-1].finish_reason == "error" and "structured" in bad[-1].error and "regex" in bad[-1].error
