"""What a gateway instance does before anything reaches a worker (``gateway/service/instance.py``), on a real
redis-server with no worker and no HTTP server: prompts tokenized and checked against the live
workers' context and vocabulary (each refusal a 400 naming its field), admission (503 with no
worker, 429 when the queue would overflow), the wire requests it builds, routing counted, fields
it ignores said once, ids."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from structlog.testing import capture_logs

from pagedserve.gateway.bodies.parse import ApiError, parse
from pagedserve.gateway.service.instance import GatewayService
from pagedserve.runtime.redis_client import connect
from pagedserve.shared.keys import Keys
from pagedserve.shared.worker_info import WorkerInfo
from tests.gateway_stack import gateway_settings
from tests.service_helpers import MODEL_NAME, messages, subscribed

CONTEXT, VOCAB = 64, 512  # what the fake worker says it takes (the zoo tokenizer's ids are all below 512)


@contextlib.asynccontextmanager
async def service_on(redis_server, zoo, worker: bool = True, context: int = CONTEXT, **settings):
    service = GatewayService(gateway_settings(redis_server.url, zoo.path("llama-gqa"), routing="shared", **settings))
    await service.start()
    redis = connect(redis_server.url)
    if worker:  # a heartbeat, as a worker writes it: nothing else of a worker is here
        info = WorkerInfo("w1", MODEL_NAME, context, VOCAB, 16, 0, 8)
        await redis.set(Keys().worker_info(MODEL_NAME, "w1"), info.encode(), px=60_000)
    try:
        yield service, redis
    finally:
        await redis.aclose()
        await service.close()


def run(redis_server, zoo, test, **options):
    async def main():
        async with service_on(redis_server, zoo, **options) as (service, redis):
            return await test(service, redis)
    return asyncio.run(main())


def parsed(service: GatewayService, body: dict, chat: bool = False):
    return parse({"model": MODEL_NAME, **body}, chat, service.limits)


def test_prompts_of_every_form_become_token_ids(redis_server, zoo):
    async def test(service, _):
        tok = service.tokenizer
        cases = {
            "text": ({"prompt": "hello world"}, False, [tok.encode("hello world")]),
            "texts": ({"prompt": ["a b", "c"]}, False, [tok.encode("a b"), tok.encode("c")]),
            "ids": ({"prompt": [5, 6, 7]}, False, [[5, 6, 7]]),
            "id lists": ({"prompt": [[5], [6, 7]]}, False, [[5], [6, 7]]),
        }
        for name, (body, chat, expected) in cases.items():
            assert await service.prompt_ids(parsed(service, body, chat)) == expected, name
        chat = await service.prompt_ids(parsed(service, {"messages": [{"role": "user", "content": "hi"}]}, chat=True))
        assert len(chat) == 1 and len(chat[0]) > 1
        assert await service.encode("hello world", chat=False) == [tok.encode("hello world")]  # not checked against the context
        assert await service.context_limit() == CONTEXT

    run(redis_server, zoo, test)


def test_a_prompt_past_the_context_or_the_vocabulary_is_a_400_naming_its_field(redis_server, zoo):
    async def test(service, _):
        errors = {}
        for name, body, chat in (("too long", {"prompt": [1] * 60, "max_tokens": 5}, False),
                                 ("too long chat", {"messages": [{"role": "user", "content": "x " * 80}], "max_tokens": 5}, True),
                                 ("unknown id", {"prompt": [1, VOCAB]}, False)):
            with pytest.raises(ApiError) as err:
                await service.prompt_ids(parsed(service, body, chat))
            errors[name] = err.value
        ok = await service.prompt_ids(parsed(service, {"prompt": [1] * 59, "max_tokens": 5}))  # exactly the context
        return errors, ok

    errors, ok = run(redis_server, zoo, test)
    long = errors["too long"]
    assert (long.status, long.param, long.code) == (400, "prompt", "context_length_exceeded")
    assert long.message == ("This model's maximum context length is 64 tokens. However, you requested 65 tokens "
                            "(60 in the prompt, 5 for the completion).")
    assert (errors["too long chat"].param, errors["too long chat"].code) == ("messages", "context_length_exceeded")
    unknown = errors["unknown id"]
    assert unknown.status == 400 and str(VOCAB) in unknown.message and unknown.param is not None
    assert ok == [[1] * 59]


def test_a_constraint_that_cannot_compile_is_a_400_and_a_tools_one_says_so(redis_server, zoo):
    async def test(service, _):
        errors = []
        bad_regex = {"prompt": "x", "guided_regex": "(unclosed"}
        bad_tool = {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}
        for body, chat in ((bad_regex, False), (bad_tool, True)):
            try:
                request = parsed(service, body, chat)
            except ApiError as err:  # refused while parsing: not this module's to test
                pytest.skip(f"refused by the schema already: {err.message}")
            with pytest.raises(ApiError) as err:
                await service.prompt_ids(request)
            errors.append(err.value)
        return errors

    regex, tool = run(redis_server, zoo, test)
    assert regex.status == 400 and regex.param == "guided_regex" and not regex.message.startswith("tools: ")
    assert tool.status == 400 and tool.param == "tools" and tool.message.startswith("tools: ")


def test_no_worker_is_a_503_and_a_full_queue_a_429_with_their_retry_after(redis_server, zoo):
    async def no_worker(service, _):
        with pytest.raises(ApiError) as err:
            async with service.admission(1):
                pass
        return err.value, await service.serving(), await service.live_models()

    error, serving, models = run(redis_server, zoo, no_worker, worker=False)
    assert (error.status, error.code, error.type, error.headers) == (503, "no_worker", "service_unavailable",
                                                                     {"Retry-After": "5"})
    assert error.message == f"no worker is serving {MODEL_NAME!r} right now" and not serving and models == []

    async def full(service, redis):
        stream = service.keys.requests(MODEL_NAME)
        for i in range(3):
            await redis.xadd(stream, {"data": b"x"})
        async with service.admission(1):  # 3 + 1 = the limit: admitted
            with pytest.raises(ApiError) as err:
                async with service.admission(1):  # and one more while the first is admitted: refused
                    pass
        async with service.admission(1):  # the first was added or refused: room again
            pass
        return err.value, await service.serving(), await service.live_models()

    error, serving, models = run(redis_server, zoo, full, max_queue_depth=4)
    assert (error.status, error.code, error.type, error.headers) == (429, "queue_full", "rate_limit_exceeded",
                                                                     {"Retry-After": "1"})
    assert error.message == f"the queue for {MODEL_NAME!r} is full (4 waiting); retry shortly"
    assert serving and models == [MODEL_NAME]


def test_wire_requests_carry_the_request_and_its_deadline_and_routes_are_counted(redis_server, zoo):
    async def test(service, _):
        request = parsed(service, {"prompt": ["a", "b"], "priority": -3, "user": "acme", "timeout": 7, "max_tokens": 4})
        wires = service.wire_requests(request, [[1, 2], [3]], ["id-a", "id-b"])
        default = service.wire_requests(parsed(service, {"prompt": "c"}), [[4]], ["id-c"])[0]
        routes = await service.routes(wires)
        shared = service.metrics.routed.labels(MODEL_NAME, "shared")._value.get()
        return wires, default, routes, shared, service.dispatcher.channel

    wires, default, routes, shared, channel = run(redis_server, zoo, test)
    assert [(w.id, w.prompt_token_ids, w.model, w.priority, w.tenant) for w in wires] == [
        ("id-a", [1, 2], MODEL_NAME, -3, "acme"), ("id-b", [3], MODEL_NAME, -3, "acme")]
    assert all(w.reply.kind == "channel" and w.reply.name == channel for w in wires)
    assert all(w.deadline - w.created == pytest.approx(7) and w.params.max_tokens == 4 for w in wires)
    assert default.deadline - default.created == pytest.approx(60.0)  # the gateway's request_timeout_s
    assert routes == [None, None] and shared == 2  # shared routing: the model's stream, counted


def test_ignored_fields_are_said_once_per_name_and_bounded(redis_server, zoo):
    async def test(service, _):
        with capture_logs() as logs:
            service.note_ignored(("foo", "bar"))
            service.note_ignored(("foo",))  # said already
            service.note_ignored(("x" * 100,) + tuple(f"f{i}" for i in range(30)))
        return logs

    logs = run(redis_server, zoo, test)
    said = [e for e in logs if e["event"] == "request fields ignored (not supported; logged once per name)"]
    assert [e["fields"] for e in said[:1]] == [["foo", "bar"]] and len(said) == 2
    assert said[1]["fields"][0] == "x" * 64 and len(said[1]["fields"]) == 20 and said[1]["log_level"] == "warning"


def test_ids_name_their_kind():
    chat, text = GatewayService.new_id(True), GatewayService.new_id(False)
    assert chat.startswith("chatcmpl-") and len(chat) == len("chatcmpl-") + 32
    assert text.startswith("cmpl-") and len(text) == len("cmpl-") + 32 and GatewayService.new_id(False) != text


def test_the_service_is_built_as_its_settings_say(redis_server, zoo):
    """Each part gets the settings and the one Redis client it should: the reply channel of this
    gateway, the routing policy's knobs, the model the metrics and dashboard label, and a connection
    pool that waits in a burst and retries a dead connection (what survives a Redis restart)."""
    from pagedserve.gateway.routing.router import RoutingPolicy

    async def test(service, _):
        return service

    with capture_logs() as logs:
        service = run(redis_server, zoo, test, gateway_id="gw-7", routing_load_weight=2.5, routing_busy_waiting=3,
                      routing_imbalance=5, max_n=3, max_tokens=77, default_chat_max_tokens=9)
    keys, redis = service.keys, service.redis
    assert service.dispatcher.client is redis and service.dispatcher.channel == keys.replies("gw-7")
    assert service.dispatcher.producer is service.producer and (service.producer.redis, service.producer.keys) == (redis, keys)
    assert (service.metrics.redis, service.metrics.keys, service.metrics.model) == (redis, keys, MODEL_NAME)
    assert (service.dashboard.redis, service.dashboard.keys, service.dashboard.model) == (redis, keys, MODEL_NAME)
    assert service.dashboard.latencies is service.metrics.recent
    assert (service.router.workers, service.router.keys, service.router.model) == (service.workers, keys, MODEL_NAME)
    assert service.router.policy == RoutingPolicy("shared", 2.5, busy_waiting=3, imbalance=5)
    assert (service.limits.max_n, service.limits.max_tokens, service.limits.default_chat_max_tokens) == (3, 77, 9)
    pool = redis.connection_pool
    retry = pool.connection_kwargs["retry"]
    assert (pool.max_connections, pool.timeout, pool.connection_kwargs["health_check_interval"]) == (64, 30, 10)
    assert (retry._retries, retry._backoff._cap, retry._backoff._base) == (3, 0.5, 0.05)
    assert service._tokenizing._max_workers == 2 and service._tokenizing._thread_name_prefix == "tokenize"
    assert MODEL_NAME in str(service.openapi) and service.sampling_defaults == {}
    assert {"event": "sampling defaults for unset request fields", "log_level": "info", "source": "auto",
            "defaults": "none"} in logs


def test_prefix_routing_follows_the_kv_events_to_the_worker_holding_the_prompt(redis_server, zoo):
    """With prefix routing the service follows the model's KV event stream from ``start`` (on a
    connection of its own) until ``close``; a prompt whose blocks a worker published goes to that
    worker's stream, with its tenant's salt, and is counted as routed by prefix."""
    from pagedserve.shared.block_hash import cache_salt, prefix_hashes
    from pagedserve.shared.kv_wire import KvEvent

    prompt = [40 + i for i in range(48)]

    async def test(service, redis):
        held = prefix_hashes(prompt, 16, cache_salt("acme", len(prompt)))
        await redis.xadd(service.keys.kv_events(MODEL_NAME), {"data": KvEvent("w1", held).encode()})
        async with asyncio.timeout(10):
            while not service.router.index.matched("w1", held).blocks:
                await asyncio.sleep(0.02)
        wires = service.wire_requests(parsed(service, {"prompt": prompt, "user": "acme"}), [prompt], ["r1"])
        routes = await service.routes(wires)
        anonymous = await service.routes(service.wire_requests(parsed(service, {"prompt": prompt}), [prompt], ["r2"]))
        prefix = service.metrics.routed.labels(MODEL_NAME, "prefix")._value.get()
        task = service._index_task
        await service.close()
        return routes, anonymous, prefix, task

    async def main():
        service = GatewayService(gateway_settings(redis_server.url, zoo.path("llama-gqa"), routing="prefix"))
        await service.start()
        redis = connect(redis_server.url)
        await redis.set(Keys().worker_info(MODEL_NAME, "w1"), WorkerInfo("w1", MODEL_NAME, 4096, VOCAB, 16, 0, 8).encode(),
                        px=60_000)
        try:
            return await test(service, redis)
        finally:
            await redis.aclose()

    routes, anonymous, prefix, task = asyncio.run(main())
    assert routes == [Keys().routed(MODEL_NAME, "w1")] and anonymous == [None]  # another tenant: another chain
    assert prefix == 1 and task.done() and not task.cancelled()  # stopped by its flag, not cancelled


def test_tokenizing_runs_on_the_gateways_threads_and_tools_reach_the_template(redis_server, zoo):
    import threading

    messages = [{"role": "user", "content": "weather in Oslo?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

    async def test(service, _):
        threads = []
        encode = service._encode

        def recorded(*args):
            threads.append(threading.current_thread().name)
            return encode(*args)

        service._encode = recorded
        plain = await service.prompt_ids(parsed(service, {"messages": messages}, chat=True))
        with_tools = await service.prompt_ids(parsed(service, {"messages": messages, "tools": tools}, chat=True))
        encoded = await service.encode(messages, chat=True)
        return threads, plain, with_tools, encoded

    threads, plain, with_tools, encoded = run(redis_server, zoo, test, context=1024)  # the tools' template is long
    assert len(threads) == 3 and all(name.startswith("tokenize") for name in threads)
    assert encoded == plain and with_tools != plain  # the chat template saw the tools


def test_a_constraint_error_is_the_compilers_own_message(redis_server, zoo):
    from pagedserve.runtime.structured_grammar import check_structured
    from pagedserve.shared.errors import InvalidRequestError

    async def test(service, _):
        request = parsed(service, {"prompt": "x", "guided_regex": "(unclosed"})
        with pytest.raises(InvalidRequestError) as own:
            check_structured(request.params.structured)
        with pytest.raises(ApiError) as err:
            await service.prompt_ids(request)
        return str(own.value), err.value.message

    own, message = run(redis_server, zoo, test)
    assert message == own


def test_ignored_names_stop_being_remembered_at_a_thousand(redis_server, zoo):
    async def test(service, _):
        service._ignored_seen = {f"seen{i}" for i in range(999)}
        with capture_logs() as logs:
            service.note_ignored(("one more",))  # the thousandth: said
            service.note_ignored(("past the bound",))  # not said, not kept
        return logs, len(service._ignored_seen)

    logs, kept = run(redis_server, zoo, test)
    assert [e["fields"] for e in logs] == [["one more"]] and kept == 1000


def test_a_cancel_is_published_on_the_models_cancel_channel(redis_server, zoo):
    from pagedserve.shared.protocol import WireCancel

    async def test(service, redis):
        pubsub = redis.pubsub()
        await subscribed(pubsub, service.keys.cancel(MODEL_NAME))
        await service.cancel(["r1", "r2"], "client gone")
        got = [WireCancel.decode(data) for data in await messages(pubsub, 2)]
        await pubsub.aclose()
        return got

    assert run(redis_server, zoo, test) == [WireCancel("r1", "client gone"), WireCancel("r2", "client gone")]


def test_the_models_generation_config_gives_the_sampling_defaults(redis_server, zoo, tmp_path):
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(zoo.path("llama-gqa"), model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "max_length": 99}))

    async def defaults(service, _):
        return service.sampling_defaults

    assert run(redis_server, zoo, defaults, model=str(model)) == {"temperature": 0.6, "top_p": 0.9}
    assert run(redis_server, zoo, defaults, model=str(model), generation_config="vllm") == {}


def test_a_gateway_starts_and_closes_while_redis_is_down(redis_server, zoo):
    """Redis down at start: the gateway comes up at once (its app answers 503s for the Redis errors
    until Redis is back) rather than waiting for it, when a load balancer would see no gateway at all."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    redis_server.stop()

    async def main():
        service = GatewayService(gateway_settings(redis_server.url, zoo.path("llama-gqa"), routing="shared"))
        async with asyncio.timeout(10):
            await service.start()
        try:
            with pytest.raises(RedisConnectionError):
                async with asyncio.timeout(30):
                    async with service.admission(1):
                        pass
        finally:
            async with asyncio.timeout(10):
                await service.close()

    asyncio.run(main())
