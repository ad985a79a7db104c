"""What real OpenAI clients send (guidellm, the SDKs, LangChain): content-part messages, vLLM's
stream options, fields we do not know. Accepted as vLLM accepts them, or a clear 400 naming the
field where the effect cannot be given."""

from __future__ import annotations

import json

import httpx
import pytest
from structlog.testing import capture_logs

from pagedserve.gateway.bodies.parse import ApiError, Limits, parse
from tests.gateway.test_gateway import VALID, greedy, sse_events
from tests.service_helpers import MODEL_NAME

CHAT = "/v1/chat/completions"


def post(stack, path: str, **body) -> httpx.Response:
    return httpx.post(stack.url + path, json={**VALID[path], **body}, timeout=60)


def test_text_content_parts_answer_like_the_plain_string(stack):
    plain = post(stack, CHAT, messages=[{"role": "user", "content": "pages\nblocks"}], max_tokens=6, **greedy())
    parts = post(stack, CHAT, max_tokens=6, **greedy(), messages=[
        {"role": "user", "content": [{"type": "text", "text": "pages"}, {"type": "text", "text": "blocks"}]}])
    assert plain.status_code == parts.status_code == 200, parts.text
    assert parts.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


@pytest.mark.parametrize("message,code", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}, "unsupported_content_type"),
    ({"role": "user", "content": [{"type": "text"}]}, None),
    ({"role": "user", "content": []}, None),
    ({"role": "tool", "content": "42"}, None),  # a tool result names the call it answers
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "t"}]}, None),  # a call names its function
])
def test_content_we_cannot_read_is_a_400_naming_the_message(stack, message, code):
    r = post(stack, CHAT, messages=[{"role": "user", "content": "hi"}, message])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages[1]" and error["code"] == code


def test_unknown_fields_are_accepted_and_logged_once_per_name(stack):
    with capture_logs() as logs:
        for _ in range(2):
            r = post(stack, "/v1/completions", store=False, metadata={"a": "b"}, some_vendor_flag=1)
            assert r.status_code == 200, r.text
    warned = [e for e in logs if e["event"].startswith("request fields ignored")]
    assert [e["fields"] for e in warned] == [["metadata", "some_vendor_flag", "store"]]


@pytest.mark.parametrize("field,inert,active", [
    ("suffix", "", "tail"), ("logit_bias", {}, {"5": 10}),
    ("functions", [], [{"name": "f"}]), ("tools", [], [{"type": "function", "function": {"name": "f"}}]),  # tools: chat only
])
def test_openai_fields_without_effect_here_pass_only_at_their_no_op_value(stack, field, inert, active):
    assert post(stack, "/v1/completions", **{field: inert}).status_code == 200
    r = post(stack, "/v1/completions", **{field: active})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_stream_options_without_streaming_are_ignored(stack):
    r = post(stack, "/v1/completions", stream_options={"include_usage": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path", sorted(VALID))
def test_continuous_usage_stats_put_the_running_usage_on_every_chunk(stack, path):
    body = {**VALID[path], "max_tokens": 5, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    *chunks, final = [json.loads(e[6:]) for e in sse_events(stack.url, path, body)]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    prompt = final["usage"]["prompt_tokens"]
    assert counts == sorted(counts) and counts[-1] == 5 and prompt > 0
    assert all(c["usage"]["prompt_tokens"] == prompt and c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"]
               for c in chunks)
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 5


def test_a_guidellm_style_chat_request_streams(stack):
    """The body guidellm 0.8 sends for a streaming chat benchmark."""
    body = {"model": MODEL_NAME, "stream": True, "max_completion_tokens": 4, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "count the blocks"}]}]}
    *chunks, final = [json.loads(e[6:]) for e in sse_events(stack.url, CHAT, body)]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert final["usage"]["completion_tokens"] == 4


def test_parse_reports_ignored_fields_and_keeps_known_ones():
    parsed = parse({"model": "m", "prompt": "x", "best_of": 2, "n": 1, "zzz": 1, "aaa": None}, False, Limits())
    assert parsed.ignored == ("aaa", "zzz") and parsed.params.best_of == 2


def test_tokenize_counts_what_a_request_would_send(stack):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    counted = httpx.post(stack.url + "/tokenize", json={"model": MODEL_NAME, "messages": messages}, timeout=30).json()
    sent = post(stack, CHAT, messages=messages, max_tokens=1).json()["usage"]["prompt_tokens"]
    assert counted["count"] == len(counted["tokens"]) == sent and counted["max_model_len"] == 2048
    plain = httpx.post(stack.url + "/tokenize", json={"prompt": "pages and blocks"}, timeout=30).json()
    assert plain["count"] == post(stack, "/v1/completions", prompt="pages and blocks").json()["usage"]["prompt_tokens"]
    back = httpx.post(stack.url + "/detokenize", json={"model": MODEL_NAME, "tokens": plain["tokens"]}, timeout=30).json()
    assert "pages and blocks" in back["prompt"]


@pytest.mark.parametrize("path,body,status", [
    ("/tokenize", {"prompt": ""}, 400), ("/tokenize", {"prompt": ["a", "b"]}, 400), ("/tokenize", [1], 400),
    ("/tokenize", {"prompt": [10**9]}, 400), ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 400),
    ("/tokenize", {"model": "other", "prompt": "x"}, 404), ("/detokenize", {"tokens": [10**9]}, 400),
    ("/detokenize", {"tokens": "abc"}, 400), ("/detokenize", {}, 400),
])
def test_tokenize_and_detokenize_refuse_bad_bodies(stack, path, body, status):
    r = httpx.post(stack.url + path, json=body, timeout=30)
    assert r.status_code == status and r.json()["error"]["message"]


def test_version_and_models_say_what_is_served(stack):
    assert httpx.get(stack.url + "/version").json()["version"]
    page = httpx.get(stack.url + "/docs")
    assert page.status_code == 200 and "/openapi.json" in page.text and page.headers["content-type"].startswith("text/html")
    assert "http" not in page.text  # everything from this gateway: the page works with no network
    for asset, kind, marker in (("/docs/swagger-ui-bundle.js", "text/javascript", b"SwaggerUIBundle"),
                                ("/docs/swagger-ui.css", "text/css", b".swagger-ui"), ("/favicon.ico", "image/png", b"PNG")):
        assert asset in page.text or asset == "/favicon.ico"
        got = httpx.get(stack.url + asset)
        assert got.status_code == 200 and got.headers["content-type"].startswith(kind) and marker in got.content[:4096 * 64]
    models = httpx.get(stack.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL_NAME] and models[0]["max_model_len"] == 2048


def test_a_prompt_past_the_workers_max_model_len_is_a_400_at_the_gateway(stack):
    """A worker started with a smaller --max-model-len reports it with its heartbeat; a gateway
    holds prompts to the smallest live one instead of letting the worker fail them."""
    from dataclasses import replace

    import redis

    from pagedserve.shared.worker_info import WorkerInfo

    client = redis.Redis.from_url(stack.redis.url)
    live = WorkerInfo.decode(client.get(stack.worker.keys.worker_info(MODEL_NAME, "test-worker")))
    assert (live.name, live.model, live.max_model_len) == ("test-worker", MODEL_NAME, 2048)  # what the real worker says
    short = stack.worker.keys.worker_info(MODEL_NAME, "short-context-worker")
    client.set(short, replace(live, name="short-context-worker", max_model_len=64).encode())  # as its heartbeat writes it
    try:
        fresh = stack.add_gateway()  # its own cache of the limit
        r = httpx.post(fresh + "/v1/completions", json={"model": MODEL_NAME, "prompt": [20] * 60, "max_tokens": 10}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded" and " 64 " in r.json()["error"]["message"]
        counted = httpx.post(fresh + "/tokenize", json={"prompt": "x"}, timeout=30).json()
        assert counted["max_model_len"] == 64
    finally:
        client.delete(short)
        client.close()


def test_each_request_leaves_one_access_line_and_a_refusal_says_why(stack):
    with capture_logs() as logs:
        assert post(stack, "/v1/completions", max_tokens=3, ignore_eos=True).status_code == 200
        assert post(stack, "/v1/completions", temperature=-1).status_code == 400
        assert httpx.get(stack.url + "/health").status_code == 200  # probes stay out of the log
    lines = [e for e in logs if e["event"] == "http"]
    assert [(e["status"], e["log_level"]) for e in lines] == [(200, "info"), (400, "warning")]
    ok, refused = lines
    assert ok["completion_tokens"] == 3 and ok["prompt_tokens"] > 0 and ok["ms"] > 0 and ok["path"] == "/v1/completions"
    assert "temperature" in refused["error"]


def test_live_answers_match_the_response_schemas_of_openapi_json(stack):
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    spec = httpx.get(stack.url + "/openapi.json").json()
    registry = Registry().with_resource("urn:spec", Resource.from_contents(spec, default_specification=DRAFT202012))
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    first = httpx.post(stack.url + "/v1/responses", json={"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2}).json()
    answers = {
        "CompletionResponse": post(stack, "/v1/completions", n=2, logprobs=1).json(),
        "ChatResponse": post(stack, CHAT).json(),
        "ModelList": httpx.get(stack.url + "/v1/models").json(),
        "TokenizeResponse": httpx.post(stack.url + "/tokenize", json={"prompt": "x"}).json(),
        "DetokenizeResponse": httpx.post(stack.url + "/detokenize", json={"tokens": [5, 6]}).json(),
        "Version": httpx.get(stack.url + "/version").json(),
        "EmbeddingList": httpx.post(stack.url + "/v1/embeddings", json={"model": MODEL_NAME, "input": ["a", "b"]}).json(),
        "Response": httpx.get(stack.url + f"/v1/responses/{first['id']}").json(),
        "DeletedResponse": httpx.delete(stack.url + f"/v1/responses/{first['id']}").json(),
        "AnthropicMessage": httpx.post(stack.url + "/v1/messages", json=chat).json(),
        "AnthropicError": httpx.post(stack.url + "/v1/messages", json={**chat, "max_tokens": 0}).json(),
        "Error": httpx.post(stack.url + "/v1/chat/completions", json={**chat, "max_tokens": 0}).json(),
    }
    assert first["object"] == "response"
    for name, body in answers.items():
        Draft202012Validator({"$ref": f"urn:spec#/components/schemas/{name}"}, registry=registry).validate(body)


def test_token_ids_written_as_integral_floats_count_as_integers(stack):
    """JSON Schema's "integer" includes 1.0, and so do the schemas in /openapi.json."""
    r = post(stack, "/v1/completions", prompt=[20.0, 21.0, 22.0], max_tokens=2, **greedy())
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3
    assert post(stack, "/v1/completions", prompt=[20.5]).status_code == 400
    assert httpx.post(stack.url + "/detokenize", json={"tokens": [5.0, 6]}).json()["prompt"] == \
        httpx.post(stack.url + "/detokenize", json={"tokens": [5, 6]}).json()["prompt"]


def test_integer_fields_take_integral_floats_and_null_means_unset():
    parsed = parse({"model": "m", "prompt": "x", "n": 2.0, "best_of": 3.0, "max_tokens": 5.0, "seed": 7.0, "top_k": None,
                    "priority": 1.0, "stream_options": None, "temperature": None}, False, Limits())
    assert (parsed.params.n, parsed.params.best_of, parsed.params.max_tokens, parsed.params.seed) == (2, 3, 5, 7)
    assert parsed.priority == 1 and parsed.params.top_k == 0 and parsed.params.temperature == 1.0
    assert parse({"model": "m", "prompt": "x", "n": None}, False, Limits()).params.n == 1
    for bad in ({"n": 2.5}, {"early_stopping": 0}, {"top_k": 2**80}, {"stream_options": {"include_usage": 1}}):
        with pytest.raises(ApiError) as err:
            parse({"model": "m", "prompt": "x", **bad}, False, Limits())
        assert err.value.param == next(iter(bad))


def test_chat_checks_max_tokens_even_when_max_completion_tokens_wins():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}
    assert parse(body, True, Limits()).params.max_tokens == 3
    with pytest.raises(ApiError) as err:
        parse({**body, "max_tokens": Limits().max_tokens + 1}, True, Limits())
    assert err.value.param == "max_tokens"


def test_every_api_says_how_much_of_the_prompt_the_prefix_cache_served(stack):
    """The same long prompt twice on each API (blocks of 16): the second answer says the cache served
    all of it in whole blocks but the last token's (which is always computed), the first less; on the
    chat route also in a stream's final usage chunk; Messages splits the prompt as Anthropic does."""
    text = " ".join(f"page{i}" for i in range(90))

    def both(path: str, body: dict, read) -> tuple[tuple[int, int], tuple[int, int]]:
        answers = [httpx.post(stack.url + path, json={"model": MODEL_NAME, **body}, timeout=60) for _ in range(2)]
        assert all(a.status_code == 200 for a in answers), answers[-1].text
        return tuple(read(a.json()) for a in answers)

    def served(first: tuple[int, int], second: tuple[int, int]) -> None:
        (early, prompt), (cached, again) = first, second
        assert prompt == again > 64 and early < cached and cached == (prompt - 1) // 16 * 16, (first, second)

    openai = lambda b: (b["usage"]["prompt_tokens_details"]["cached_tokens"], b["usage"]["prompt_tokens"])
    served(*both("/v1/completions", {"prompt": "completions " + text, "max_tokens": 2, "temperature": 0}, openai))
    chat = {"messages": [{"role": "user", "content": "chat " + text}], "max_tokens": 2, "temperature": 0}
    served(*both(CHAT, chat, openai))
    streamed = sse_events(stack.url, CHAT, {"model": MODEL_NAME, **chat, "stream": True,
                                            "stream_options": {"include_usage": True}})
    last = json.loads(streamed[-1].removeprefix(b"data: "))
    assert (last["choices"], openai(last)) == ([], openai(post(stack, CHAT, **chat).json()))
    served(*both("/v1/responses", {"input": "responses " + text, "max_output_tokens": 2, "temperature": 0},
                 lambda b: (b["usage"]["input_tokens_details"]["cached_tokens"], b["usage"]["input_tokens"])))
    anthropic = lambda b: (b["usage"]["cache_read_input_tokens"], b["usage"]["input_tokens"] + b["usage"]["cache_read_input_tokens"])
    served(*both("/v1/messages", {"messages": [{"role": "user", "content": "messages " + text}], "max_tokens": 2,
                                  "temperature": 0}, anthropic))
