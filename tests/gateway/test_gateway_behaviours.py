"""Gateway behaviours users rely on, end to end: tenant prefix-cache salt, timeouts, multi-prompt
completions, context length, Redis down, API keys."""

from __future__ import annotations

import httpx
import pytest

from pagedserve.embedded_redis import free_port
from pagedserve.shared.sampling import SamplingParams
from tests.gateway.test_gateway import greedy
from tests.service_helpers import MODEL_NAME


def completion(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, **body}, timeout=60)


def test_the_user_field_salts_the_prefix_cache(stack):
    """Requests of one tenant share cached prompt blocks; another tenant's identical prompt does not."""
    stats = stack.engine.scheduler.stats
    prompt = list(range(100, 164))  # four full blocks of 16

    def hits(user: str) -> int:
        before = stats.prefix_hit_tokens
        assert completion(stack.url, prompt=prompt, max_tokens=1, user=user).status_code == 200
        return stats.prefix_hit_tokens - before

    hits("tenant-a")  # fills the cache for tenant-a
    assert hits("tenant-a") == 48  # three blocks: the last prompt token is always recomputed
    assert hits("tenant-b") == 0


def test_a_request_timeout_aborts_it_at_the_worker(stack):
    r = completion(stack.url, prompt="go", max_tokens=1000, ignore_eos=True, timeout=0.3)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "abort"
    assert body["usage"]["completion_tokens"] < 1000
    assert not stack.worker.inflight


def test_several_prompts_give_prompt_major_choices_and_summed_usage(stack, offline):
    prompts = ["pages", "blocks and tables"]
    r = completion(stack.url, prompt=prompts, n=2, max_tokens=5, seed=4, temperature=1.0)
    assert r.status_code == 200, r.text
    body = r.json()
    want = offline.generate(prompts, SamplingParams(n=2, max_tokens=5, seed=4, temperature=1.0), use_tqdm=False)
    by_index = {c["index"]: c["text"] for c in body["choices"]}
    assert by_index == {p * 2 + o.index: o.text for p, out in enumerate(want) for o in out.outputs}
    assert body["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in want)
    assert body["usage"]["completion_tokens"] == sum(len(o.token_ids) for out in want for o in out.outputs)


def test_a_prompt_past_the_context_is_context_length_exceeded(stack):
    r = completion(stack.url, prompt=[20] * 1500, max_tokens=1000)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and "2048" in error["message"] and error["param"] == "prompt"


def test_redis_down_is_503_with_retry_after(stack):
    dead = stack.add_gateway(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    r = completion(dead, prompt="x", max_tokens=2)
    assert r.status_code == 503 and r.headers["Retry-After"]
    assert r.json()["error"]["code"] == "redis_unavailable"
    assert httpx.get(dead + "/ready").status_code == 503
    assert httpx.get(dead + "/health").status_code == 200


@pytest.fixture(scope="module")
def keyed(stack) -> str:
    return stack.add_gateway(api_keys=("first", "second"))


@pytest.mark.parametrize("header, status", [
    (None, 401), ("Bearer wrong", 401), ("Bearer first", 200), ("Bearer second", 200), ("second", 200),
    ("Bearer first-and-more", 401), ("Bearer", 401), ("Basic Zmlyc3Q=", 401),
])
def test_api_keys(keyed, header, status):
    url = keyed
    headers = {"Authorization": header} if header is not None else {}
    r = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1},
                   headers=headers, timeout=60)
    assert r.status_code == status, r.text
    if status == 401:
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/health").status_code == 200  # open paths need no key


def test_a_non_ascii_authorization_header_is_a_401(keyed):
    r = httpx.post(keyed + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x"},
                   headers=[(b"Authorization", b"Bearer k\xe9y\xff")], timeout=30)  # not even UTF-8
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_admission_counts_the_entries_a_request_adds(stack):
    small = stack.add_gateway(max_queue_depth=2)
    assert completion(small, prompt=["a", "b"], max_tokens=1).status_code == 200
    r = completion(small, prompt=["a", "b", "c"], max_tokens=1)  # an empty queue, but three entries > 2
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"


def test_chat_completion_through_the_sdk_matches_offline(client, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    got = client.chat.completions.create(messages=messages, max_tokens=10, **greedy())
    want = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)[0]
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
