"""``--async-scheduling`` as a service: through the gateway, plain and streamed completions carry the
tokens the offline engine gives one step at a time, and clients that leave mid-stream (their requests
aborted while a step runs ahead) leave no block held and no placeholder in any stream."""

from __future__ import annotations

import openai

from pagedserve import LLM
from pagedserve.shared.sampling import SamplingParams
from tests.gateway_stack import running_stack
from tests.service_helpers import MODEL_NAME, poll


def test_an_async_worker_answers_through_the_gateway_as_one_step_at_a_time(tmp_path_factory, zoo):
    path = zoo.path("llama-gqa")
    prompts = [f"item {i}: " + "word " * (3 + i) for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].text for o in LLM(path, device="cpu", dtype="float32", num_gpu_blocks=256)
            .generate(prompts, params, use_tqdm=False)]
    with running_stack(tmp_path_factory, path, num_gpu_blocks=256, async_scheduling=True) as stack:
        engine, ahead = stack.engine, []
        real = engine.scheduler.run_ahead
        engine.scheduler.run_ahead = lambda plan: (ahead.append(len(plan.seqs)), real(plan))[1]
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        options = dict(model=MODEL_NAME, max_tokens=24, temperature=0.0, extra_body={"ignore_eos": True})
        got = [client.completions.create(prompt=p, **options).choices[0].text for p in prompts]
        streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=prompts[0], stream=True, **options)
                           if c.choices)
        for prompt in prompts:  # clients gone after two chunks: their requests end while steps run ahead
            stream = client.completions.create(prompt=prompt, stream=True, **{**options, "max_tokens": 400})
            for _, _ in zip(range(2), stream):
                pass
            stream.close()
        poll(lambda: engine.scheduler.blocks.usage().used == 0 and not engine.scheduler.requests, 30,
             "every left request to end and free its blocks")
    assert got == want and streamed == want[0]
    assert len(ahead) > 24  # the steps ran ahead
