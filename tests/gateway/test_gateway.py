"""The gateway over real HTTP, a real Redis and a real worker: the official openai SDK, byte-level
SSE, bad input, backpressure, auth, disconnects and many concurrent streams."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pagedserve.embedded_redis import RedisServer
from shared.sampling import SamplingParams
from tests.gateway_stack import Stack
from tests.service_helpers import MODEL_NAME
from pagedserve import LLM
from worker.engine import Engine
from worker.core.engine_config import EngineConfig


@pytest.fixture(scope="module")
def stack(zoo, tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    engine = Engine(EngineConfig(model=str(zoo.path("llama-gqa")), dtype="float32", num_gpu_blocks=1024, max_num_seqs=64))
    try:
        s = Stack(server, engine, zoo.path("llama-gqa")).start()
        yield s
        s.stop()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def offline(zoo):
    return LLM(zoo.path("llama-gqa"), dtype="float32", num_gpu_blocks=512)


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(**kw):
    return dict(model=MODEL_NAME, temperature=0.0, **kw)


def test_completion_matches_the_offline_engine(client, offline):
    got = client.completions.create(prompt="The quick brown fox", max_tokens=20, **greedy())
    want = offline.generate(["The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)[0]
    assert got.choices[0].text == want.outputs[0].text
    assert got.choices[0].finish_reason == want.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert got.object == "text_completion" and got.id.startswith("cmpl-")


def test_streaming_completion_with_usage(client):
    full = client.completions.create(prompt="Memory is cut", max_tokens=16, **greedy())
    chunks = list(client.completions.create(prompt="Memory is cut", max_tokens=16, stream=True,
                                            stream_options={"include_usage": True}, **greedy()))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_chat_streaming_and_not(client, offline):
    messages = [{"role": "user", "content": "hello there"}]
    full = client.chat.completions.create(messages=messages, max_tokens=12, **greedy())
    want = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert full.choices[0].message.content == want.text and full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(messages=messages, max_tokens=12, stream=True, **greedy()))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text


def test_n_stop_and_logprobs(client, offline):
    two = client.completions.create(prompt="A", max_tokens=8, n=2, temperature=1.0, seed=3, model=MODEL_NAME)
    assert sorted(c.index for c in two.choices) == [0, 1]
    base = client.completions.create(prompt="pages and blocks", max_tokens=30, **greedy()).choices[0].text
    stop = base[8:11]
    cut = client.completions.create(prompt="pages and blocks", max_tokens=30, stop=[stop], **greedy()).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base[: base.index(stop)]
    lp = client.completions.create(prompt="blocks", max_tokens=4, logprobs=2, **greedy()).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4 and all(v <= 0 for v in lp.token_logprobs)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "x"}], max_tokens=3, logprobs=True,
                                          top_logprobs=2, **greedy()).choices[0].logprobs
    assert len(chat.content) == 3 and all(len(t.top_logprobs) >= 2 for t in chat.content)


def test_sse_framing_is_byte_exact(stack):
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes())
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    for event in events[:-2]:
        assert event.startswith(b"data: {") and b"\n" not in event
        assert json.loads(event[6:])["object"] == "text_completion"
    assert len(events) == 3 + 2


BAD_BODIES = [
    (b"not json", 400), (json.dumps([1, 2]).encode(), 400), (json.dumps({"prompt": "x"}).encode(), 400),
    (json.dumps({"model": MODEL_NAME}).encode(), 400), (json.dumps({"model": MODEL_NAME, "prompt": ""}).encode(), 400),
    (json.dumps({"model": MODEL_NAME, "prompt": "x", "temperature": -1}).encode(), 400),
    (json.dumps({"model": MODEL_NAME, "prompt": "x", "echo": True}).encode(), 400),
    (json.dumps({"model": MODEL_NAME, "prompt": "x", "n": 1000}).encode(), 400),
    (json.dumps({"model": MODEL_NAME, "prompt": "x", "max_tokens": 5000}).encode(), 400),
    (json.dumps({"model": MODEL_NAME, "prompt": "x", "stop": ["a"] * 9}).encode(), 400),
    (json.dumps({"model": MODEL_NAME, "prompt": [10**9]}).encode(), 400),
    (json.dumps({"model": MODEL_NAME, "prompt": "x", "max_tokens": 1000, "stream_options": {"include_usage": True}}).encode(), 400),
    (json.dumps({"model": "nope", "prompt": "x"}).encode(), 404),
    (json.dumps({"model": MODEL_NAME, "prompt": "x" * 2_000_000}).encode(), 413),
]


@pytest.mark.parametrize("body,status", BAD_BODIES)
def test_bad_input_gets_a_4xx_in_openai_shape(stack, body, status):
    r = httpx.post(stack.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["type"]


JSON = st.recursive(st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
FIELDS = st.sampled_from(["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "n", "stop", "logprobs",
                          "stream", "stream_options", "seed", "top_logprobs", "timeout", "priority", "user"])


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       body=st.dictionaries(FIELDS, JSON, max_size=6), with_model=st.booleans())
def test_fuzzed_bodies_never_get_a_5xx(stack, path, body, with_model):
    if with_model:
        body["model"] = MODEL_NAME
        body.setdefault("max_tokens", 2) if isinstance(body.get("max_tokens"), int) else None
    r = httpx.post(stack.url + path, json=body, timeout=60)
    assert r.status_code < 500, (body, r.text)


def test_auth_backpressure_and_missing_workers(stack):
    keyed = stack.add_gateway(api_keys=("sekret",))
    assert httpx.post(keyed + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x"}).status_code == 401
    ok = httpx.post(keyed + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2},
                    headers={"Authorization": "Bearer sekret"}, timeout=30)
    assert ok.status_code == 200
    assert httpx.get(keyed + "/health").status_code == 200
    orphan = stack.add_gateway(served_model_name="nobody")
    r = httpx.post(orphan + "/v1/completions", json={"model": "nobody", "prompt": "x"})
    assert r.status_code == 503 and r.headers["Retry-After"] and httpx.get(orphan + "/ready").status_code == 503

    async def fill():
        import redis.asyncio as aioredis

        r = aioredis.from_url(stack.redis.url)
        await r.set("pagedserve:alive:crowded:ghost", "x", ex=30)
        for _ in range(3):
            await r.xadd("pagedserve:requests:crowded", {"data": b"x"})
        await r.aclose()

    stack.run(fill())
    crowded = stack.add_gateway(served_model_name="crowded", max_queue_depth=2)
    r = httpx.post(crowded + "/v1/completions", json={"model": "crowded", "prompt": "x"})
    assert r.status_code == 429 and r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "queue_full"


def test_models_ready_metrics_openapi(stack, client):
    client.completions.create(prompt="metrics please", max_tokens=3, **greedy())
    assert MODEL_NAME in [m.id for m in client.models.list().data]
    assert httpx.get(stack.url + "/ready").json()["status"] == "ready"
    time.sleep(0.5)  # a worker heartbeat carries its gauges
    text = httpx.get(stack.url + "/metrics").text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "prompt_tokens_total", "generation_tokens_total", "num_requests_running", "num_requests_waiting",
                 "kv_cache_usage_perc", "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total"):
        assert f"pagedserve:{name}" in text, name
    spec = httpx.get(stack.url + "/openapi.json").json()
    assert "/v1/chat/completions" in spec["paths"]


def test_disconnect_mid_stream_frees_the_blocks(stack):
    body = {"model": MODEL_NAME, "prompt": "go on", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    deadline = time.monotonic() + 10
    while (stack.worker.inflight or stack.engine.scheduler.blocks.usage().used) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not stack.worker.inflight
    assert stack.engine.scheduler.blocks.usage().used == 0


def test_200_concurrent_streams_all_complete_in_order(stack):
    async def one(http: httpx.AsyncClient, i: int):
        body = {"model": MODEL_NAME, "prompt": [10 + i % 300, 11, 12], "max_tokens": 6, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        chunks = []
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])
        assert chunks[-1] == "[DONE]"
        parsed = [json.loads(c) for c in chunks[:-1]]
        assert parsed[-1]["usage"]["completion_tokens"] == 6
        assert parsed[-2]["choices"][0]["finish_reason"] == "length"
        return "".join(p["choices"][0]["text"] for p in parsed if p["choices"])

    async def main():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(base_url=stack.url, limits=limits, timeout=120) as http:
            return await asyncio.gather(*(one(http, i) for i in range(200)))

    texts = asyncio.run(main())
    assert len(texts) == 200


def test_best_of_and_beam_search_through_the_api(client, offline):
    best = client.completions.create(prompt="pages", max_tokens=6, n=1, best_of=3, temperature=1.0, seed=2, model=MODEL_NAME)
    assert len(best.choices) == 1 and best.choices[0].finish_reason == "length"
    beams = client.completions.create(prompt="blocks and pages", max_tokens=10, n=2, model=MODEL_NAME,
                                      extra_body={"use_beam_search": True, "beam_width": 3})
    want = offline.generate(["blocks and pages"], SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=10),
                            use_tqdm=False)[0]
    assert [c.text for c in sorted(beams.choices, key=lambda c: c.index)] == [o.text for o in want.outputs]
    chunks = list(client.completions.create(prompt="blocks and pages", max_tokens=10, n=2, model=MODEL_NAME, stream=True,
                                            extra_body={"use_beam_search": True, "beam_width": 3}))
    texts = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[0], texts[1]] == [o.text for o in want.outputs]  # the final beams, sent at the end
