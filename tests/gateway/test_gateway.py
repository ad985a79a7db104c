"""The gateway over real HTTP, a real Redis and a real worker: the official openai SDK, byte-level
SSE, bad input, backpressure, auth, disconnects and many concurrent streams."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pagedserve.shared.sampling import SamplingParams
from tests.service_helpers import MODEL_NAME, ChannelTap, poll


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
    want = offline.generate(["A"], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8), use_tqdm=False)[0]
    assert [c.text for c in sorted(two.choices, key=lambda c: c.index)] == [o.text for o in want.outputs]
    base = client.completions.create(prompt="pages and blocks", max_tokens=30, **greedy()).choices[0].text
    stop = base[8:11]
    cut = client.completions.create(prompt="pages and blocks", max_tokens=30, stop=[stop], **greedy()).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base[: base.index(stop)]
    assert cut.stop_reason == stop and client.completions.create(  # vLLM's field: which stop ended it, else null
        prompt="pages and blocks", max_tokens=30, **greedy()).choices[0].stop_reason is None
    ask = dict(messages=[{"role": "user", "content": "pages and blocks"}], max_tokens=30, **greedy())
    chat_stop = client.chat.completions.create(**ask).choices[0].message.content[8:11]
    said = client.chat.completions.create(**ask, stop=[chat_stop]).choices[0]
    final = [c.choices[0] for c in client.chat.completions.create(**ask, stop=[chat_stop], stream=True) if c.choices][-1]
    assert (said.finish_reason, said.stop_reason) == (final.finish_reason, final.stop_reason) == ("stop", chat_stop)
    lp = client.completions.create(prompt="blocks", max_tokens=4, logprobs=2, **greedy()).choices[0].logprobs
    ref = offline.generate(["blocks"], SamplingParams(temperature=0.0, max_tokens=4, logprobs=2), use_tqdm=False)[0]
    ref_entries = ref.outputs[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ref_entries)
    assert lp.token_logprobs == pytest.approx([e[t].logprob for t, e in zip(ref.outputs[0].token_ids, ref_entries)], abs=1e-5)
    for top, entry in zip(lp.top_logprobs, ref_entries):
        assert sorted(top.values(), reverse=True) == pytest.approx(sorted(e.logprob for e in entry.values())[::-1], abs=1e-5)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "x"}], max_tokens=3, logprobs=True,
                                          top_logprobs=2, **greedy()).choices[0].logprobs
    assert len(chat.content) == 3
    for token in chat.content:  # exactly the two best, best first; greedy picked the best
        assert len(token.top_logprobs) == 2 and token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob, abs=1e-6)


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


def sse_events(url: str, path: str, body: dict) -> list[bytes]:
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes())
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    return events[:-2]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_include_usage_puts_usage_null_on_every_chunk_on_the_wire(stack, path):
    body = {**VALID[path], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    events = sse_events(stack.url, path, body)
    *chunks, last = events
    assert chunks and all(b'"usage":null' in chunk for chunk in chunks)
    usage = json.loads(last[6:])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    kind = b'"object":"chat.completion.chunk"' if "chat" in path else b'"object":"text_completion"'
    assert all(kind in e for e in events)
    without = sse_events(stack.url, path, {**body, "stream_options": None})
    assert all(b'"usage"' not in e for e in without)


def test_a_worker_error_ends_the_stream_with_an_error_event(stack):
    """A request the engine refuses (it can never fit the KV pool) is an error event, then [DONE]."""
    body = {**VALID["/v1/chat/completions"], "max_tokens": 1024, "n": 16, "stream": True}  # 16 x 65 blocks > 1,024
    events = sse_events(stack.url, "/v1/chat/completions", body)
    error = json.loads(events[-1][6:])
    assert "error" in error and "KV blocks" in error["error"]["message"], error


BAD_BODIES = [
    (b"not json", 400), (json.dumps([1, 2]).encode(), 400), (json.dumps({"prompt": "x"}).encode(), 400),
    (json.dumps({"model": MODEL_NAME}).encode(), 400), (json.dumps({"model": MODEL_NAME, "prompt": ""}).encode(), 400),
    (json.dumps({"model": MODEL_NAME, "prompt": "x", "temperature": -1}).encode(), 400),
    (json.dumps({"model": MODEL_NAME, "prompt": "x", "echo": True, "stream": True}).encode(), 400),
    (json.dumps({"model": MODEL_NAME, "prompt": "x", "echo": "yes"}).encode(), 400),
    (json.dumps({"model": MODEL_NAME, "prompt": "x", "n": 1000}).encode(), 400),
    (json.dumps({"model": MODEL_NAME, "prompt": "x", "max_tokens": 5000}).encode(), 400),
    (json.dumps({"model": MODEL_NAME, "prompt": "x", "stop": ["a"] * 9}).encode(), 400),
    (json.dumps({"model": MODEL_NAME, "prompt": [10**9]}).encode(), 400),
    (json.dumps({"model": MODEL_NAME, "prompt": "x", "stream": True, "stream_options": {"include_usage": 3}}).encode(), 400),
    (json.dumps({"model": MODEL_NAME, "prompt": "x", "priority": 2**64}).encode(), 400),
    (json.dumps({"model": MODEL_NAME, "prompt": "x", "priority": 1001}).encode(), 400),
    (json.dumps({"model": MODEL_NAME, "prompt": "x", "stop_token_ids": [2**64]}).encode(), 400),
    (json.dumps({"model": MODEL_NAME, "prompt": "x", "user": "u" * 257}).encode(), 400),
    (json.dumps({"model": MODEL_NAME, "prompt": ["x"] * 33, "n": 2}).encode(), 400),
    (b'{"model": "tiny", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400),
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


VALID = {
    "/v1/completions": {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2},
    "/v1/chat/completions": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}


def test_fuzzed_bodies_never_get_a_5xx(stack):
    """Valid requests with one field replaced by arbitrary JSON (or removed): most still reach a
    worker, and none may get a 5xx."""
    statuses = []

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
    @given(path=st.sampled_from(sorted(VALID)), field=FIELDS, value=JSON, how=st.sampled_from(["set", "set", "drop", "keep"]))
    def one(path, field, value, how):
        body = dict(VALID[path])
        if how == "set":
            body[field] = value
        elif how == "drop":
            body.pop(field, None)
        r = httpx.post(stack.url + path, json=body, timeout=60)
        assert r.status_code < 500, (body, r.text)
        statuses.append(r.status_code)

    one()
    assert statuses.count(200) >= len(statuses) // 4, sorted(statuses)


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

        from pagedserve.shared.keys import Keys
        from pagedserve.shared.worker_info import WorkerInfo

        r = aioredis.from_url(stack.redis.url)
        ghost = WorkerInfo("ghost", "crowded", max_model_len=2048, vocab_size=512, block_size=16, rope_switch=0, max_num_seqs=4)
        await r.set(Keys().worker_info("crowded", "ghost"), ghost.encode(), ex=30)  # a live worker, as the gateway sees one
        for _ in range(3):
            await r.xadd("pagedserve:{crowded}:requests", {"data": b"x"})
        await r.aclose()

    stack.run(fill())
    crowded = stack.add_gateway(served_model_name="crowded", max_queue_depth=2)
    r = httpx.post(crowded + "/v1/completions", json={"model": "crowded", "prompt": "x"})
    assert r.status_code == 429 and r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "queue_full"


VLLM_METRICS = {  # vLLM V1's names and types (prometheus_client drops a counter's _total in the family name)
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter", "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
}


def metric_types(url: str) -> dict[str, str]:
    from prometheus_client.parser import text_string_to_metric_families

    return {family.name: family.type for family in text_string_to_metric_families(httpx.get(url + "/metrics").text)}


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` as ``{"name{label=value,...}": value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    return {sample.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())) + "}": sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_models_ready_metrics_openapi(stack, client):
    label = f"model_name={MODEL_NAME}"
    before = scrape(stack.url)
    usages = [client.completions.create(prompt=[20 + i, 21, 22], max_tokens=3, extra_body={"ignore_eos": True},
                                        **greedy()).usage for i in range(3)]
    after = scrape(stack.url)

    def delta(name: str, labels: str = label) -> float:
        key = f"vllm:{name}{{{labels}}}"
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert [u.completion_tokens for u in usages] == [3, 3, 3]
    assert delta("generation_tokens_total") == 9
    assert delta("prompt_tokens_total") == sum(u.prompt_tokens for u in usages) == 9
    assert delta("time_to_first_token_seconds_count") == 3
    assert delta("inter_token_latency_seconds_count") == 6  # tokens 2 and 3 of each request
    assert delta("e2e_request_latency_seconds_count") == 3
    assert delta("request_queue_time_seconds_count") == 3  # reported once per request, by the worker
    assert delta("request_success_total", f"finished_reason=length,{label}") == 3
    gaps = f"pagedserve:request_longest_gap_seconds_count{{{label}}}"
    assert after.get(gaps, 0.0) - before.get(gaps, 0.0) == 3  # each request's longest gap, once
    assert MODEL_NAME in [m.id for m in client.models.list().data]
    assert httpx.get(stack.url + "/ready").json()["status"] == "ready"
    # Worker gauges come with its heartbeats: the prefix-cache queries of these prompts show up.
    poll(lambda: scrape(stack.url).get(f"vllm:prefix_cache_queries_total{{{label}}}", 0)
         >= before.get(f"vllm:prefix_cache_queries_total{{{label}}}", 0) + 9, 10, "the worker's gauges")
    steps = f"pagedserve:engine_step_seconds_count{{{label}}}"  # the worker's step-time histogram, summed
    poll(lambda: scrape(stack.url).get(steps, 0) >= before.get(steps, 0) + 9, 10, "the steps: 3 a request at least")
    kinds = metric_types(stack.url)
    for name, kind in VLLM_METRICS.items():
        assert kinds.get(name) == kind, (name, kinds.get(name))
    assert {"pagedserve:kv_cow_copies", "pagedserve:queue_depth", "pagedserve:dead_letters"} <= set(kinds)
    assert kinds["pagedserve:engine_step_seconds"] == kinds["pagedserve:request_longest_gap_seconds"] == "histogram"
    spec = httpx.get(stack.url + "/openapi.json").json()
    assert "/v1/chat/completions" in spec["paths"]


def test_disconnect_mid_stream_cancels_and_frees_the_blocks(stack):
    """Only the gateway's cancel can end this request early: the worker's last event on the wire
    must be an abort after a handful of its 1,000 tokens."""
    tap = stack.run(ChannelTap(stack.redis.url, "pagedserve:cancel:*", "pagedserve:replies:*").start())
    body = {"model": MODEL_NAME, "prompt": "go on", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=60) as r:
        for i, line in enumerate(r.iter_lines()):
            if line.startswith("data: {"):
                request_id = json.loads(line[6:])["id"]
            if i > 6:
                break
    poll(lambda: any(e.done for e in tap.events(request_id)), 10, "the worker's terminal event")
    poll(lambda: not stack.worker.inflight and not stack.engine.scheduler.blocks.usage().used, 10, "blocks freed")
    stack.run(tap.stop())
    assert [(c.id, c.reason) for c in tap.cancels()] == [(request_id, "client gone")]
    events = tap.events(request_id)
    assert events[-1].finish_reason == "abort"
    assert sum(len(o.token_ids) for e in events for o in e.outputs) < 500


def test_200_concurrent_streams_all_complete_in_order(stack, offline):
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
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = offline.generate([[10 + i % 300, 11, 12] for i in range(200)], params, use_tqdm=False)
    assert texts == [o.outputs[0].text for o in want]  # each stream got its own request's text


def test_best_of_and_beam_search_through_the_api(client, offline):
    best = client.completions.create(prompt="pages", max_tokens=6, n=1, best_of=3, temperature=1.0, seed=2, model=MODEL_NAME)
    want_best = offline.generate(["pages"], SamplingParams(n=1, best_of=3, temperature=1.0, seed=2, max_tokens=6),
                                 use_tqdm=False)[0].outputs
    assert [c.text for c in best.choices] == [o.text for o in want_best] and best.choices[0].finish_reason == "length"
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


def test_an_unreadable_worker_info_is_skipped(stack):
    """A key in the directory's place that is not a WorkerInfo (a foreign writer, an older worker)
    costs nothing but a log line: requests and /v1/models go on with the live worker."""
    import redis

    from pagedserve.shared.keys import Keys

    client = redis.Redis.from_url(stack.redis.url)
    junk = Keys().worker_info(MODEL_NAME, "junk")
    client.set(junk, b"\xc1 not a worker", ex=30)
    try:
        fresh = stack.add_gateway()
        r = httpx.post(fresh + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        listed = httpx.get(fresh + "/v1/models")
        assert listed.status_code == 200 and MODEL_NAME in [m["id"] for m in listed.json()["data"]]
    finally:
        client.delete(junk)
        client.close()
