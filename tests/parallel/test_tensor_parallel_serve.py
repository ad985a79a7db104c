"""Tensor parallel as a service: a TP=2 worker answers through the gateway as the offline TP=1
engine does (plain and streamed), and when its rank 1 is SIGKILLed mid-stream the worker exits
(code 3, as after a broken device, for its supervisor to restart) and every stream it held ends
on the other worker with all its tokens, in order; restarted, it starts new ranks and serves."""

from __future__ import annotations

import asyncio
import os
import signal

import openai
import pytest
import redis.asyncio as aioredis

from pagedserve import LLM
from pagedserve.runtime.client import QueueClient
from pagedserve.shared.keys import Keys
from pagedserve.shared.sampling import SamplingParams
from tests.gateway_stack import running_stack
from tests.pagedserve.test_up import alive, descendants
from tests.serve.test_worker_recovery import start_worker_process, stream_is_clean, wait_alive
from tests.service_helpers import MODEL_NAME, apoll, collect

KEYS = Keys()
PROMPT = "The tensor-parallel worker says"


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (its followers)."""
    return sorted(descendants(pid))


def test_a_tp2_worker_answers_through_the_gateway_as_the_offline_engine(tmp_path_factory, zoo):
    path = zoo.path("llama-gqa")
    offline = LLM(path, device="cpu", dtype="float32", num_gpu_blocks=64)
    want = offline.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    with running_stack(tmp_path_factory, path, tensor_parallel_size=2, num_gpu_blocks=64) as stack:
        assert len(stack.engine.ranks.processes) == 1
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        got = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0.0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == want.outputs[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True}) if c.choices)
        assert streamed == want.outputs[0].text
    assert all(p.poll() is not None for p in stack.engine.ranks.processes)  # the worker's stop ended its ranks


@pytest.mark.slow
def test_rank_1_sigkilled_mid_stream_ends_its_worker_and_every_stream_completes_elsewhere(redis_server, zoo):
    path = zoo.path("llama-gqa")
    prompts = [[30 + i % 90] * (8 + i % 13) for i in range(16)]
    params = SamplingParams(max_tokens=300, ignore_eos=True, temperature=0.0)
    expected = [o.outputs[0].token_ids for o in LLM(path, device="cpu", dtype="float32", num_gpu_blocks=512)
                .generate(prompts, params, use_tqdm=False)]

    async def main():
        r = aioredis.from_url(redis_server.url)
        workers = {"tp": start_worker_process(redis_server.url, path, "tp", "--tensor-parallel-size", "2")}
        try:
            await wait_alive(r, "tp")
            followers = children(workers["tp"].pid)
            assert len(followers) == 1, followers
            async with QueueClient(redis_server.url) as client:
                streams = [await client.submit(MODEL_NAME, prompt_token_ids=p, params=params) for p in prompts]
                started: set[str] = set()

                async def note(event) -> None:
                    started.add(event.id)

                tasks = [asyncio.create_task(collect(s, note, timeout=300)) for s in streams]
                await apoll(lambda: len(started) == len(prompts), 120, "every request to stream")
                workers["plain"] = start_worker_process(redis_server.url, path, "plain")
                await wait_alive(r, "plain")
                os.kill(followers[0], signal.SIGKILL)
                code = await asyncio.get_running_loop().run_in_executor(None, workers["tp"].wait, 30)
                results = await asyncio.wait_for(asyncio.gather(*tasks), 240)
                await apoll(lambda: stream_is_clean(r), 10, "the dead worker's entries to be acknowledged")
                log = "".join(workers["tp"].log)
                # restarted, as its supervisor would: new ranks, and it serves (the other worker stopped first)
                workers["plain"].kill()
                workers["tp"] = start_worker_process(redis_server.url, path, "tp", "--tensor-parallel-size", "2")
                await wait_alive(r, "tp")
                assert len(children(workers["tp"].pid)) == 1
                again = await collect(await client.submit(MODEL_NAME, prompt_token_ids=prompts[0], params=params), timeout=120)
            return code, results, log, again
        finally:
            for proc in workers.values():
                proc.kill()
                proc.wait()
            await r.aclose()

    code, results, log, again = asyncio.run(main())
    assert code == 3, log[-2000:]
    assert again.tokens() == expected[0]
    assert "tensor-parallel rank 1" in log and "exiting for a restart" in log, log[-2000:]
    for got, want in zip(results, expected):
        assert [e.seq for e in got.events] == list(range(len(got.events)))
        assert got.last.finish_reason == "length" and got.tokens() == want


def test_a_sigkilled_tp_worker_leaves_no_rank_behind(redis_server, zoo):
    """Rank 0 killed outright runs no cleanup: its followers end by their collective failing or by
    their parent changing."""
    async def main():
        r = aioredis.from_url(redis_server.url)
        worker = start_worker_process(redis_server.url, zoo.path("llama-gqa"), "tp", "--tensor-parallel-size", "2")
        try:
            await wait_alive(r, "tp")
            followers = children(worker.pid)
            worker.send_signal(signal.SIGKILL)
            worker.wait()
            await apoll(lambda: not any(map(alive, followers)), 10, "the followers to end")
            return followers
        finally:
            worker.kill()
            worker.wait()
            await r.aclose()

    assert len(asyncio.run(main())) == 1



def test_an_idle_tp_worker_whose_rank_dies_exits_for_a_restart(redis_server, zoo):
    """No step is running to notice: the engine loop asks between its idle waits."""
    async def main():
        r = aioredis.from_url(redis_server.url)
        worker = start_worker_process(redis_server.url, zoo.path("llama-gqa"), "tp", "--tensor-parallel-size", "2")
        try:
            await wait_alive(r, "tp")
            os.kill(children(worker.pid)[0], signal.SIGKILL)
            return await asyncio.get_running_loop().run_in_executor(None, worker.wait, 20), "".join(worker.log)
        finally:
            worker.kill()
            worker.wait()
            await r.aclose()

    code, log = asyncio.run(main())
    assert code == 3 and "tensor-parallel rank 1" in log, log[-2000:]
