"""Prefix-aware routing: block hashes equal across processes, KV events from the engine thread to
the gateway's index, requests routed to the worker holding their prefix (real Redis, two real
workers, a real gateway over HTTP), and a dead worker's own stream taken over; the service tests
run on one redis-server and on a real three-master Redis Cluster."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from pagedserve.gateway.app import create_app
from pagedserve.gateway.routing.kv_index import KvIndex
from pagedserve.runtime.redis_client import connect
from pagedserve.shared.block_hash import block_hash, cache_salt, prefix_hashes
from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.keys import Keys
from pagedserve.shared.kv_wire import KvEvent
from pagedserve.shared.protocol import ReplyTarget, WireRequest, pack
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.core.kv_cache.kv_events import KvEvents
from pagedserve.worker.engine import Engine
from pagedserve.worker.setup.engine_config import EngineConfig
from tests.gateway_stack import gateway_settings
from tests.service_helpers import MODEL_NAME, apoll, events_of, settings_for

KEYS = Keys()


def test_block_hashes_agree_across_processes_whatever_the_hash_seed():
    tokens = list(range(100, 180))
    code = ("from shared.block_hash import prefix_hashes, cache_salt; "
            "print(prefix_hashes(list(range(100, 180)), 16, cache_salt('tenant-a', 80, 64)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout
    assert eval(out) == prefix_hashes(tokens, 16, cache_salt("tenant-a", 80, 64))
    hashes = prefix_hashes(tokens, 16)
    assert len(hashes) == 4  # 80 tokens: 5 full blocks, the last token always computed
    assert hashes[1] == block_hash(hashes[0], tokens[16:32]) != block_hash(None, tokens[16:32])
    assert prefix_hashes(tokens, 16, "tenant-a") != hashes and prefix_hashes(tokens, 16, cache_salt(None, 80, 79)) != hashes


def test_kv_events_merge_to_net_changes_and_the_index_follows_them():
    events = KvEvents()
    for h in (1, 2, 3):
        events.published(h)
    events.dropped(2)  # each hash is told in the list of its last state
    events.dropped(9)
    events.lowered(3)
    events.lowered(4)
    events.published(4)  # promoted back to the device
    assert events.take() == ([1, 4], [2, 9], False, [3]) and not events
    events.published(5)
    events.reset([7, 8], [6])
    events.dropped(8)  # after a reset only what it lists needs telling
    events.dropped(99)
    events.lowered(7)
    assert events.take() == ([], [], True, [6, 7])

    index = KvIndex()
    index.apply(KvEvent("w1", [10, 11, 12]))
    index.apply(KvEvent("w2", [10]))
    index.apply(KvEvent("w1", [], [11]))
    assert index.matched("w1", [10, 11, 12]) == (1, 0) and index.matched("w2", [10, 11]) == (1, 0)
    index.apply(KvEvent("w1", [11], lowered=[10]))  # 10 left the device for a tier below, 11 came back
    index.apply(KvEvent("w1", [], lowered=[12]))
    assert index.matched("w1", [10, 11, 12, 13]) == (1, 2) and index.matched("w1", [10, 11, 12]).blocks == 3
    index.apply(KvEvent("w1", [], [12]))  # gone from every tier
    assert index.matched("w1", [10, 11, 12]) == (1, 1) and index.lower["w1"] == {10}
    index.apply(KvEvent("w1", [20], reset=True))
    assert index.blocks["w1"] == {20} and not index.lower["w1"] and index.matched("nobody", [10]) == (0, 0)
    assert KvEvent.decode(pack({"w": "old", "p": [1], "d": [], "r": False})) == KvEvent("old", [1])  # before tiers
    for junk in (b"", b"\x93\x01\x02\x03", KvEvent("w", [1]).encode()[:-1]):
        with pytest.raises(InvalidRequestError):
            KvEvent.decode(junk)
    with pytest.raises(InvalidRequestError):
        KvEvent.decode(KvEvent("w", ["not a hash"]).encode())  # type: ignore[list-item]


@contextlib.asynccontextmanager
async def cluster_of_workers(url: str, model_path, names: list[str], **gateway_overrides):
    """Workers with their own engines and a gateway, all on this loop; yields (gateway url, gateway state, workers)."""
    from pagedserve.worker.serve.service import WorkerService

    workers, tasks = [], []
    for name in names:
        engine = Engine(EngineConfig(model=str(model_path), device="cpu", dtype="float32", num_gpu_blocks=256,
                                     max_num_seqs=16))
        service = WorkerService(settings_for(url, model_path, consumer=name, heartbeat_s=0.3), engine)
        workers.append(service)
        tasks.append(asyncio.create_task(service.run()))
    r = connect(url)
    for name in names:
        await apoll(lambda n=name: r.exists(KEYS.metrics(MODEL_NAME, n)), 60, f"worker {name}")
    settings = gateway_settings(url, model_path, **gateway_overrides)
    app = create_app(settings)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, settings.host, settings.port).start()
    try:
        yield f"http://127.0.0.1:{settings.port}", app, workers
    finally:
        await runner.cleanup()
        for service in workers:
            service.request_stop()
        assert await asyncio.gather(*tasks) == [0] * len(names)
        await r.aclose()


async def hit_tokens(r, names: list[str]) -> int:
    values = [await r.hget(KEYS.metrics(MODEL_NAME, n), "prefix_cache_hits_total") for n in names]
    return sum(int(float(v or 0)) for v in values)


async def counted(r, names: list[str], asked: int) -> bool:
    """Whether the workers' heartbeats count ``asked`` prompt tokens looked up (every request in)."""
    values = [await r.hget(KEYS.metrics(MODEL_NAME, n), "prefix_cache_queries_total") for n in names]
    return sum(int(float(v or 0)) for v in values) >= asked


def shared_prompt_workload(rounds: int = 4, prompts: int = 5) -> list[list[int]]:
    """``prompts`` system prompts of 64 tokens (4 blocks), each followed by a different question
    ``rounds`` times, round-robin."""
    systems = [[20 + (7 * i + 13 * k) % 400 for i in range(64)] for k in range(prompts)]
    return [systems[k] + [30 + (r * 31 + k * 5 + j) % 400 for j in range(8)] for r in range(rounds) for k in range(prompts)]


@pytest.mark.parametrize("routing", ["prefix", "shared"])
def test_requests_go_to_the_worker_holding_their_prefix(redis_url, zoo, routing):
    """Five 64-token system prompts, each asked four times in turn, on two workers. Prefix routing:
    every repeat lands where its system prompt is cached (3 x 5 x 64 hit tokens, the most there can
    be); shared routing lands each on whichever worker reads first (Redis hands sequential entries
    to the two blocked readers in turn, so a prompt alternates between them)."""
    from pagedserve.gateway.app import STATE

    async def scenario():
        names = ["w1", "w2"]
        # Requests follow one another faster than heartbeats report the load: what the router counts as
        # sent and waiting never turns one away here (load balancing has tests of its own)
        async with cluster_of_workers(redis_url, zoo.path("llama-gqa"), names, routing=routing,
                                      routing_busy_waiting=1000) as (url, app, _):
            r = connect(redis_url)
            index = app[STATE].router.index
            workload = shared_prompt_workload()
            async with aiohttp.ClientSession() as http:
                for prompt in workload:
                    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0}
                    async with http.post(url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                    if routing == "prefix":  # its KV events reach the index before the next request is routed
                        last = prefix_hashes(prompt, 16)[-1]
                        await apoll(lambda: any(last in held for held in index.blocks.values()), 30,
                                    "the request's KV events in the gateway's index")
                asked = sum(len(p) for p in workload)
                await apoll(lambda: counted(r, names, asked), 30, "the heartbeats that count every request")
                hits = await hit_tokens(r, names)
                async with http.get(url + "/metrics") as resp:
                    metrics = await resp.text()
            state = app[STATE]
            await r.aclose()
            return hits, metrics, state.router.index.blocks

    hits, metrics, index = asyncio.run(scenario())
    routed = next((float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("pagedserve:routed_requests_total") and 'route="prefix"' in line), 0.0)
    if routing == "prefix":
        assert hits == 3 * 5 * 64, hits
        assert routed == 15 and any(index.values())
    else:
        assert routed == 0 and hits < 3 * 5 * 64


def test_a_dead_workers_routed_entries_are_served_by_another(redis_url, zoo):
    """Entries on the own stream of a worker that stopped beating, one never read and one it had
    been handed, are moved to the shared stream and served by a live worker."""
    from pagedserve.runtime.producer import Producer
    from pagedserve.runtime.replies import ReplyDispatcher

    async def scenario():
        r = connect(redis_url)
        ghost = KEYS.routed(MODEL_NAME, "ghost")
        dispatcher = ReplyDispatcher(r, KEYS.replies("gw-test"), Producer(r, KEYS))
        await dispatcher.start()
        requests = [WireRequest(id=f"req-{i}", model=MODEL_NAME, params=SamplingParams(temperature=0.0, max_tokens=5),
                                reply=ReplyTarget("channel", dispatcher.channel), prompt_token_ids=[40 + i, 41, 42])
                    for i in range(2)]
        boxes = [dispatcher.open(req) for req in requests]
        await r.xgroup_create(ghost, KEYS.group(MODEL_NAME), id="0", mkstream=True)
        await dispatcher.send(boxes[:1], [ghost])
        await r.xreadgroup(KEYS.group(MODEL_NAME), "ghost", {ghost: ">"}, count=1)  # handed to the ghost, never served
        await dispatcher.send(boxes[1:], [ghost])
        async with cluster_of_workers(redis_url, zoo.path("llama-gqa"), ["w1"]):
            done = [await asyncio.wait_for(_tokens(box), 30) for box in boxes]
            assert not await r.exists(ghost)
        await dispatcher.stop()
        await r.aclose()
        return done

    done = asyncio.run(scenario())
    want = [zoo.hf_greedy("llama-gqa", [40 + i, 41, 42], 5) for i in range(2)]
    assert done == want


async def _tokens(box) -> list[int]:
    events = await events_of(box)
    assert all(event.error is None for event in events), events[-1].error
    return [t for event in events for o in event.outputs for t in o.token_ids]


def test_a_simulated_worker_runs_the_real_scheduler_with_calibrated_step_times(zoo):
    """``--simulate``: no weights, steps sleep ``base + per_seq x seqs + per_token x tokens``; the
    prefix cache and its KV events work as with the model."""
    import time

    from pagedserve.worker.serve.settings import worker_settings

    engine = Engine(EngineConfig(model=str(zoo.path("llama-gqa")), simulate="0.01,0.001,0.0001", num_gpu_blocks=64))
    engine.scheduler.blocks.gpu.events = events = KvEvents()
    system = list(range(20, 84))
    for i in range(3):
        engine.add_request(str(i), system + [100 + i], SamplingParams(temperature=0.0, max_tokens=4))
    started, steps = time.monotonic(), 0
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
        steps += 1
    elapsed = time.monotonic() - started
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs.values())
    prefill = 0.01 + 0.003 + 0.0001 * 3 * 65
    assert elapsed >= prefill + 3 * (0.01 + 0.003 + 0.0003) * 0.95
    published = events.take().published
    assert published[:4] == prefix_hashes(system + [100], 16)[:4]
    with pytest.raises(SystemExit):
        worker_settings(["--simulate", "0.01,fast,0"])


def test_a_draining_worker_gives_back_only_what_it_never_read(redis_server):
    from pagedserve.worker.serve.bridge import RedisBridge

    async def scenario():
        r = aioredis.from_url(redis_server.url)
        bridge = RedisBridge(r, KEYS, MODEL_NAME, "w1")
        await bridge.ensure_group()
        for i in range(3):
            await r.xadd(bridge.own, {"data": b"entry-%d" % i})
        held = await bridge.read(1, None)
        assert [e.data for e in held] == [b"entry-0"] and held[0].entry_id.startswith("r:")
        assert await bridge.give_back_unread() == 2
        shared = await r.xrange(bridge.stream)
        assert [f[b"data"] for _, f in shared] == [b"entry-1", b"entry-2"] and all(f[b"deliveries"] == b"0" for _, f in shared)
        assert await r.xlen(bridge.own) == 1  # the one being served stays, and is acknowledged there
        await bridge.ack([held[0].entry_id])
        assert await r.xlen(bridge.own) == 0 and not (await r.xpending(bridge.own, bridge.group))["pending"]
        await r.aclose()

    asyncio.run(scenario())


async def routed(url: str, infos: list, held: dict[str, list[int]], prompt: list[int], tenant: str | None = None,
                 times: int = 1, then=None, below: dict[str, list[int]] | None = None, adapter: str | None = None) -> list:
    """What a router over these workers' infos (written into real Redis as heartbeats write them)
    and prefix caches (as their KV events say: ``held`` on the device, ``below`` on a lower tier)
    does with ``prompt`` ``times`` in a row (the loads read once); then what ``await then(router)``
    returns, if given."""
    from pagedserve.gateway.routing.router import Router, RoutingPolicy
    from pagedserve.gateway.routing.worker_directory import WorkerDirectory

    r = connect(url)
    try:
        await r.flushall()
        for info in infos:
            await r.set(KEYS.worker_info(MODEL_NAME, info.name), info.encode(), px=60_000)
        router = Router(WorkerDirectory(r, KEYS, ttl_s=3600), KEYS, MODEL_NAME, RoutingPolicy())
        for name, hashes in held.items():
            router.index.apply(KvEvent(name, hashes))
        for name, hashes in (below or {}).items():
            router.index.apply(KvEvent(name, lowered=hashes))
        routes = [await router.route(prompt, tenant, adapter) for _ in range(times)]
        return routes if then is None else await then(router)
    finally:
        await r.aclose()


def worker_info(name: str, running: int = 0, waiting: int = 0, max_num_seqs: int = 64, block_size: int = 16,
                rope_switch: int = 0, adapters: tuple[str, ...] = ()):
    from pagedserve.shared.worker_info import WorkerInfo

    return WorkerInfo(name, MODEL_NAME, 4096, 512, block_size, rope_switch, max_num_seqs, running=running, waiting=waiting,
                      adapters=adapters)


def test_a_prefix_below_a_workers_device_counts_for_less_than_one_on_it(redis_url):
    prompt = [40 + i for i in range(80)]
    chain = prefix_hashes(prompt, 16)
    infos = [worker_info("w1"), worker_info("w2")]

    def route(device: dict[str, int], lower: dict[str, int]) -> str | None:
        return asyncio.run(routed(redis_url, infos, {n: chain[:k] for n, k in device.items()}, prompt,
                                  below={n: chain[:k] for n, k in lower.items()}))[0]

    assert route({}, {"w1": 4}) == KEYS.routed(MODEL_NAME, "w1")  # a hit below is still a hit
    assert route({"w2": 3}, {"w1": 4}) == KEYS.routed(MODEL_NAME, "w2")  # 3 on a device beat 4 x 0.5 below
    assert route({"w2": 1}, {"w1": 4}) == KEYS.routed(MODEL_NAME, "w1")
    assert route({"w1": 1}, {"w1": 4, "w2": 2}) == KEYS.routed(MODEL_NAME, "w1")  # lowered: off w1's device


def test_the_router_weighs_load_and_passes_over_a_busy_or_overloaded_worker(redis_url):
    """The score's load term and the three gates, under load (the service tests route one request
    at a time, where load is always near zero)."""
    prompt = [40 + i for i in range(80)]  # five blocks of 16; a hit can cover the first four
    chain = prefix_hashes(prompt, 16)

    def route(loads: dict[str, tuple[int, int, int]], blocks: dict[str, int], times: int = 1) -> list[str | None]:
        infos = [worker_info(name, running, waiting, max_num_seqs) for name, (running, waiting, max_num_seqs) in loads.items()]
        return asyncio.run(routed(redis_url, infos, {name: chain[:n] for name, n in blocks.items()}, prompt, times=times))

    def stream(name: str) -> str:
        return KEYS.routed(MODEL_NAME, name)

    # The load term: w1 holds more of the prompt (4 blocks against 3) but runs 14 of its 16.
    assert route({"w1": (14, 0, 16), "w2": (0, 0, 16)}, {"w1": 4, "w2": 3}) == [stream("w2")]
    assert route({"w1": (0, 0, 16), "w2": (0, 0, 16)}, {"w1": 4, "w2": 3}) == [stream("w1")]
    # ... as a share of the worker's capacity: 2 of 64 running costs 0.03, less than a block's 0.2.
    assert route({"w1": (2, 0, 64), "w2": (0, 0, 64)}, {"w1": 4, "w2": 3}) == [stream("w1")]
    # One sequence at most: running it costs the whole 1.0, more than w1's extra 0.6 of the prompt.
    assert route({"w1": (1, 0, 1), "w2": (0, 0, 1)}, {"w1": 4, "w2": 1}) == [stream("w2")]
    # The busy gate: 8 waiting on the only worker holding the prefix sends it to the shared stream.
    assert route({"w1": (0, 8, 64), "w2": (0, 0, 64)}, {"w1": 4}) == [None]
    # Between reports what was routed counts as waiting: the ninth request in a row is not sent.
    assert route({"w1": (0, 0, 64), "w2": (0, 0, 64)}, {"w1": 4}, times=9) == [stream("w1")] * 8 + [None]
    # The imbalance gate: 16 more held (running, waiting, routed since) than the least loaded worker.
    assert route({"w1": (16, 0, 64), "w2": (0, 0, 64)}, {"w1": 4}) == [None]
    assert route({"w1": (15, 0, 64), "w2": (0, 0, 64)}, {"w1": 4}) == [stream("w1")]
    assert route({"w1": (10, 6, 64), "w2": (0, 0, 64)}, {"w1": 4}) == [None]
    assert route({"w1": (20, 0, 64), "w2": (6, 0, 64)}, {"w1": 4}) == [stream("w1")]  # 14 more than the least
    assert route({"w1": (12, 0, 64), "w2": (0, 0, 64)}, {"w1": 4}, times=5) == [stream("w1")] * 4 + [None]
    # min_match_blocks (1): one block is enough, none is not.
    assert route({"w1": (0, 0, 64)}, {"w1": 1}) == [stream("w1")]
    assert route({"w1": (0, 0, 64)}, {"w1": 0}) == [None]


def test_the_router_hashes_as_each_worker_does_and_forgets_the_gone(redis_url, monkeypatch):
    """Each worker's chain is the prompt hashed with its block size, the tenant's salt and its
    long-rope switch; prompts too short to hash go to the shared stream; no worker, no route; a
    worker silent for a minute leaves the index."""
    prompt = [40 + i for i in range(80)]

    def route(infos, held, tenant=None, prompt=prompt):
        return asyncio.run(routed(redis_url, infos, held, prompt, tenant))

    def stream(name: str) -> str:
        return KEYS.routed(MODEL_NAME, name)

    by16, by8 = prefix_hashes(prompt, 16), prefix_hashes(prompt, 8)
    infos = [worker_info("w16"), worker_info("w8", block_size=8)]
    assert route(infos, {"w16": by16, "w8": by8}) == [stream("w8")]  # 72 of 80 tokens against 64
    assert route(infos, {"w16": by16, "w8": by8[:2]}) == [stream("w16")]
    tenant_chain = prefix_hashes(prompt, 16, cache_salt("acme", len(prompt)))
    assert route([worker_info("w1")], {"w1": tenant_chain}, tenant="acme") == [stream("w1")]
    assert route([worker_info("w1")], {"w1": by16}, tenant="acme") == [None]
    long_chain = prefix_hashes(prompt, 16, cache_salt(None, len(prompt), 50))  # past the switch at 50
    assert route([worker_info("w1", rope_switch=50)], {"w1": long_chain}) == [stream("w1")]
    assert route([worker_info("w1", rope_switch=50)], {"w1": by16}) == [None]
    one = [worker_info("w1", block_size=1)]
    assert route(one, {"w1": prefix_hashes([5, 6], 1)}, prompt=[5, 6]) == [stream("w1")]
    assert route(one, {"w1": prefix_hashes([5, 6], 1)}, prompt=[5]) == [None]
    assert route([], {}) == [None]

    from pagedserve.gateway.routing import worker_directory

    now = [1000.0]
    monkeypatch.setattr(worker_directory.time, "monotonic", lambda: now[0])

    async def forgetting(router) -> list[bool]:
        router.workers.ttl_s = 0.1  # read the loads again at each step of the clock below
        kept = []
        for later in (60.0, 60.5):
            now[0] = 1000.0 + later
            await router.route(prompt, None)
            kept.append("gone" in router.index.blocks)
        return kept

    assert asyncio.run(routed(redis_url, [worker_info("w1")], {"gone": by16}, prompt, then=forgetting)) == [True, False]


def test_an_adapter_request_goes_by_its_salted_prefix_to_a_worker_holding_the_adapter(redis_url):
    """Workers list their LoRA adapters as NAME@DIGEST, the salt their blocks carry: the router
    hashes an adapter request's prompt the same way and considers only the workers holding it."""
    from pagedserve.gateway.routing.worker_directory import Workers

    prompt = [40 + i for i in range(80)]
    key = "sql@0123456789abcdef"
    salted, plain = prefix_hashes(prompt, 16, cache_salt((key, None), len(prompt))), prefix_hashes(prompt, 16)
    infos = [worker_info("w1", adapters=(key,)), worker_info("w2")]

    def route(held: dict[str, list[int]], adapter: str | None) -> str | None:
        return asyncio.run(routed(redis_url, infos, held, prompt, adapter=adapter))[0]

    assert route({"w1": salted}, key) == KEYS.routed(MODEL_NAME, "w1")
    assert route({"w1": plain}, key) is None  # the base model's blocks are not the adapter's
    assert route({"w2": salted}, key) is None  # w2 does not hold the adapter: never chosen
    assert route({"w1": salted}, None) is None  # nor does a base request match the adapter's blocks
    both = Workers((infos[0], worker_info("w3", adapters=("sql@fedcba9876543210",))), 0.0)
    assert Workers(tuple(infos), 0.0).adapter_key("sql") == key and both.adapter_key("sql") is None  # mid-reload
    assert both.adapters == ["sql"]


def test_an_adapter_request_never_takes_the_shared_stream_while_a_worker_lacks_the_adapter(redis_url):
    """A worker whose load failed (or one starting) does not list the adapter: with no prefix to
    route by, the request goes to the least loaded holder's own stream, not to the shared one that
    worker also reads; where every worker holds it, the shared stream is fine."""
    from pagedserve.gateway.routing.worker_directory import Workers

    prompt = [40 + i for i in range(80)]
    key = "sql@0123456789abcdef"

    def route(infos) -> list:
        async def both(router):
            workers = Workers(tuple(infos), 0.0)
            return [await router.route_request(workers, prompt, None, "sql"),
                    await router.route_request(workers, prompt, None, "sql"), await router.route_request(workers, prompt, None)]
        return asyncio.run(routed(redis_url, infos, {}, prompt, then=both))

    busy_holder, idle_holder = worker_info("w1", running=5, adapters=(key,)), worker_info("w2", running=1, adapters=(key,))
    lacking = worker_info("w3")
    # the idle holder, then (its routed request counted as waiting) still the less loaded of the two; base: shared
    assert route([busy_holder, idle_holder, lacking]) == [KEYS.routed(MODEL_NAME, "w2")] * 2 + [None]
    assert route([busy_holder, idle_holder]) == [None, None, None]  # everyone holds it: the shared stream
    mid_reload = [worker_info("w1", adapters=("sql@fedcba9876543210",)), idle_holder, lacking]
    assert route(mid_reload)[0] in (KEYS.routed(MODEL_NAME, "w1"), KEYS.routed(MODEL_NAME, "w2"))  # either bytes, a holder
    assert route([lacking]) == [None, None, None]  # nobody holds it (the gateway answered 404 before this)
