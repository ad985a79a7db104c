"""Speculative decoding as a service: a worker with ``--speculative-config`` answers through the
gateway with the tokens the offline engine gives without speculation (plain and streamed, drafts
kept), and when a speculative worker is SIGKILLed mid-stream every stream it held ends on the other
worker with all its tokens, in order, numbered without a gap (a step that keeps a run of drafts
sends several tokens at once; a resumed stream must not count them twice)."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import redis.asyncio as aioredis

from pagedserve import LLM
from pagedserve.runtime.client import QueueClient
from pagedserve.shared.keys import Keys
from pagedserve.shared.sampling import SamplingParams
from tests.engine.test_speculative import prompts as drafting_prompts
from tests.gateway_stack import running_stack
from tests.serve.test_worker_recovery import start_worker_process, stream_is_clean, wait_alive
from tests.service_helpers import MODEL_NAME, apoll, collect

KEYS = Keys()
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def test_a_speculative_worker_answers_through_the_gateway_as_the_engine_without_it(tmp_path_factory, zoo):
    path = zoo.path("llama-gqa")
    prompts = drafting_prompts(4)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].text for o in LLM(path, device="cpu", dtype="float32", num_gpu_blocks=64)
            .generate(prompts, params, use_tqdm=False)]
    with running_stack(tmp_path_factory, path, num_gpu_blocks=64, speculative_config=json.dumps(NGRAM)) as stack:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        options = dict(model=MODEL_NAME, max_tokens=32, temperature=0.0, extra_body={"ignore_eos": True})
        got = [client.completions.create(prompt=p, **options).choices[0].text for p in prompts]
        streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=prompts[0], stream=True, **options)
                           if c.choices)
        stats = stack.engine.stats()
    assert got == want and streamed == want[0]
    # Drafts were made and some kept; how many are made depends on the step times the pace is fitted to.
    assert 0 < stats["spec_decode_num_accepted_tokens_total"] <= stats["spec_decode_num_draft_tokens_total"]


@pytest.mark.slow
def test_a_speculative_worker_sigkilled_mid_stream_leaves_every_stream_whole(redis_server, zoo):
    path = zoo.path("llama-gqa")
    prompts = [[30 + i % 7, 40 + i % 5] * (4 + i % 6) for i in range(16)]  # they repeat: lookup finds drafts
    params = [SamplingParams(max_tokens=300, ignore_eos=True, temperature=0.0) if i % 2 else
              SamplingParams(max_tokens=300, ignore_eos=True, temperature=0.8, seed=i) for i in range(16)]
    expected = [o.outputs[0].token_ids for o in LLM(path, device="cpu", dtype="float32", num_gpu_blocks=512)
                .generate(prompts, params, use_tqdm=False)]
    spec = ("--speculative-config", json.dumps(NGRAM))

    async def main():
        r = aioredis.from_url(redis_server.url)
        workers = {name: start_worker_process(redis_server.url, path, name, *spec) for name in ("w1", "w2")}
        try:
            for name in workers:
                await wait_alive(r, name)
            async with QueueClient(redis_server.url) as client:
                streams = [await client.submit(MODEL_NAME, prompt_token_ids=p, params=sp) for p, sp in zip(prompts, params)]
                started: set[str] = set()

                async def note(event) -> None:
                    started.add(event.id)

                tasks = [asyncio.create_task(collect(s, note, timeout=300)) for s in streams]
                await apoll(lambda: len(started) == len(prompts), 120, "every request to stream")
                owners = await r.xpending_range(KEYS.requests(MODEL_NAME), KEYS.group(MODEL_NAME), "-", "+", 100)
                held = {w: sum(o["consumer"].decode() == w for o in owners) for w in workers}
                victim = max(held, key=held.get)
                workers[victim].kill()
                results = await asyncio.wait_for(asyncio.gather(*tasks), 240)
            await apoll(lambda: stream_is_clean(r), 10, "the dead worker's entries to be acknowledged")
            survivor = next(w for w in workers if w != victim)

            async def survivor_drafted() -> bool:  # its latest metrics, written at each heartbeat
                kept = await r.hget(KEYS.metrics(MODEL_NAME, survivor), "spec_decode_num_accepted_tokens_total")
                return kept is not None and float(kept) > 0

            await apoll(survivor_drafted, 10, "the surviving worker's metrics to show drafts kept")
            return results, held[victim]
        finally:
            for proc in workers.values():
                proc.kill()
                proc.wait()
            await r.aclose()

    results, held = asyncio.run(main())
    assert held >= 4, f"the victim held {held} streams"
    for got, want in zip(results, expected):
        assert [e.seq for e in got.events] == list(range(len(got.events)))  # in order, nothing twice
        assert got.last.finish_reason == "length" and got.tokens() == want
