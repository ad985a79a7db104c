"""The engine on CUDA (marker ``gpu``; skipped without a device): greedy parity with transformers
on the same device, every sampling feature, n > 1, beam search, both preemption modes, prefix-cache
hits, a full token budget under the memory-profiled KV pool, and the whole stack over the SDK.

float32 must match transformers token for token (Triton prefill uses IEEE dot products, matmuls
run without TF32). bfloat16 kernels sum in another order than transformers' SDPA, so there the
check is on the first step's logits: within 3% of their largest magnitude.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM
from pagedserve.shared.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.engine.test_device_discipline import FEATURES
from tests.engine.test_parity import run_checked

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
VOCAB = 512


def hf_cuda(zoo, name: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(zoo.path(name), dtype=dtype).to("cuda").eval()


def hf_greedy_cuda(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             pad_token_id=model.config.pad_token_id)
    return out[0, len(prompt):].tolist()


def cuda_llm(zoo, name="llama-gqa", **kwargs) -> LLM:
    llm = LLM(zoo.path(name), dtype=kwargs.pop("dtype", "float32"), device="cuda", **kwargs)
    assert llm.engine.runner.kv_pool.device.type == "cuda"
    return llm


def assert_greedy_parity(zoo, llm: LLM, cases, name="llama-gqa") -> None:
    model = hf_cuda(zoo, name, torch.float32)
    done = run_checked(llm, [p for p, _ in cases], [SamplingParams(temperature=0.0, max_tokens=n) for _, n in cases])
    for i, (prompt, n) in enumerate(cases):
        assert done[i].outputs[0].token_ids == hf_greedy_cuda(model, prompt, n), f"request {i}"


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3", "llama3-rope"])
def test_float32_greedy_parity_on_cuda(zoo, name):
    cases = random_prompts(seed=1, count=24, max_len=400, vocab=VOCAB, max_new=120)
    assert_greedy_parity(zoo, cuda_llm(zoo, name, num_gpu_blocks=2048), cases, name)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_parity_under_preemption_on_cuda(zoo, mode):
    cases = random_prompts(seed=2, count=24, max_len=120, vocab=VOCAB, max_new=80)
    llm = cuda_llm(zoo, block_size=8, num_gpu_blocks=60, num_cpu_blocks=200, preemption_mode=mode,
                   max_num_batched_tokens=256)
    assert_greedy_parity(zoo, llm, cases)
    assert llm.engine.scheduler.stats.num_preemptions > 0


def test_parity_with_prefix_cache_hits_and_forks_on_cuda(zoo):
    system = [11 + (i * 7) % 400 for i in range(150)]
    cases = [(system + p, n) for p, n in random_prompts(seed=4, count=16, max_len=60, vocab=VOCAB, max_new=40)]
    llm = cuda_llm(zoo, num_gpu_blocks=2048)
    assert_greedy_parity(zoo, llm, cases)
    assert llm.engine.scheduler.stats.prefix_hit_tokens > 0
    forks = run_checked(llm, [cases[0][0]], [SamplingParams(temperature=0.0, max_tokens=20, n=3)])
    assert len({tuple(o.token_ids) for o in forks[0].outputs}) == 1


def test_every_sampling_feature_and_beam_search_on_cuda(zoo):
    llm = cuda_llm(zoo, num_gpu_blocks=64, block_size=8, num_cpu_blocks=256, preemption_mode="swap")
    params = list(FEATURES.values())
    done = run_checked(llm, [[20 + i, *range(30, 45)] for i in range(len(params))], params)
    failed = {name: done[i].error for i, name in enumerate(FEATURES) if not done[i].finished or done[i].error}
    assert not failed, failed
    seeded = FEATURES["seeded"]
    again = run_checked(llm, [[20 + list(FEATURES).index("seeded"), *range(30, 45)]], [seeded])
    assert again[0].outputs[0].token_ids == done[list(FEATURES).index("seeded")].outputs[0].token_ids


def test_bfloat16_first_step_logits_are_close_to_transformers(zoo):
    prompt = list(range(20, 120))
    llm = cuda_llm(zoo, dtype="bfloat16", num_gpu_blocks=256)
    engine = llm.engine
    engine.add_request("x", prompt, SamplingParams(max_tokens=1))
    step = engine.runner.forward(engine.scheduler.schedule())
    ours = step.logits[0].float()
    with torch.inference_mode():
        theirs = hf_cuda(zoo, "llama-gqa", torch.bfloat16)(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
    assert (ours - theirs).abs().max() <= 0.03 * theirs.abs().max()
    engine.abort("x")
    engine.step()


def test_a_full_token_budget_fits_the_profiled_pool(zoo):
    """The pool is sized after a worst-case step: a step of max_num_batched_tokens runs."""
    llm = cuda_llm(zoo, max_num_batched_tokens=2048, max_num_seqs=256, gpu_memory_utilization=0.5)
    prompts = [[20 + (i * 13 + j) % 400 for j in range(256)] for i in range(8)]  # 8 x 256 = one full step
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)


def test_the_whole_stack_streams_from_a_gpu_worker(tmp_path, monkeypatch):
    import openai

    from pagedserve.stack import LocalStack

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("REDIS_URL", raising=False)
    with LocalStack(model="demo") as stack:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x")
        chunks = list(client.chat.completions.create(model=stack.served_model_name, stream=True, max_tokens=8,
                                                     messages=[{"role": "user", "content": "hello"}]))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3", "gemma2", "mistral-window", "phi3"])
def test_cuda_graphs_give_the_eager_tokens(zoo, name):
    cases = random_prompts(seed=8, count=40, max_len=200, vocab=VOCAB, max_new=60)  # batch sizes across buckets
    params = [SamplingParams(temperature=0.0, max_tokens=n) for _, n in cases]
    graphed = cuda_llm(zoo, name, num_gpu_blocks=2048)
    assert graphed.engine.runner.graphs is not None
    eager = cuda_llm(zoo, name, num_gpu_blocks=2048, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    a = run_checked(graphed, [p for p, _ in cases], params)
    b = run_checked(eager, [p for p, _ in cases], params)
    assert [a[i].outputs[0].token_ids for i in range(len(cases))] == [b[i].outputs[0].token_ids for i in range(len(cases))]
    graphs = graphed.engine.runner.graphs  # every graph wrote its logits into the one buffer
    assert len(graphs._buckets) > 1 and all(b.logits.data_ptr() == graphs._logits.data_ptr() for b in graphs._buckets.values())


@pytest.mark.parametrize("name,method", [("llama-gqa", "ngram"), ("qwen3", "ngram"), ("llama-gqa", "draft_model")])
def test_cuda_graphs_checking_drafts_give_the_eager_tokens(zoo, name, method):
    """n-gram or draft-model drafts checked in graphs of rows of 2 to 5 token places (prompts that
    repeat, so n-gram drafts come) give the eager engine's tokens and accept as many drafts; the
    graphs of rows of drafts were replayed, and the draft model's rounds through graphs of its own."""
    cases = [(p * 6, n) for p, n in random_prompts(seed=9, count=24, max_len=12, vocab=VOCAB, max_new=60)]
    params = [SamplingParams(temperature=0.0, max_tokens=n) for _, n in cases]
    spec = {"method": method, "num_speculative_tokens": 4, **({"model": str(zoo.path(name))} if method == "draft_model" else {})}
    graphed = cuda_llm(zoo, name, num_gpu_blocks=2048, speculative_config=spec)
    eager = cuda_llm(zoo, name, num_gpu_blocks=2048, enforce_eager=True, speculative_config=spec)
    a = run_checked(graphed, [p for p, _ in cases], params)
    b = run_checked(eager, [p for p, _ in cases], params)
    assert [a[i].outputs[0].token_ids for i in range(len(cases))] == [b[i].outputs[0].token_ids for i in range(len(cases))]
    accepted = "spec_decode_num_accepted_tokens_total"
    assert graphed.engine.stats()[accepted] == eager.engine.stats()[accepted] > 0
    runner = graphed.engine.runner
    assert any(width > 1 for _, width, _ in runner.graphs._buckets)
    assert method != "draft_model" or runner.drafter.graphs._buckets


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_async_scheduling_gives_the_tokens_of_one_step_at_a_time_and_its_decode_launches_never_wait(zoo, graphs):
    """``--async-scheduling`` on CUDA: greedy and seeded tokens and logprobs equal one step at a time
    (stops, penalties and preemption among the steps), and launching a decode step while the one before still
    runs never synchronizes with the device (``torch.cuda.set_sync_debug_mode("error")`` raises on any
    wait: an upload that waits for the stream, a value read back)."""
    cases = random_prompts(seed=21, count=16, max_len=40, vocab=VOCAB, max_new=48)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=n, logprobs=1 if i % 3 else None,
                             stop_token_ids=[7] if i % 5 == 0 else [], repetition_penalty=1.4 if i % 4 == 1 else 1.0,
                             frequency_penalty=0.5 if i % 4 == 2 else 0.0)
              for i, (_, n) in enumerate(cases)]
    options = dict(num_gpu_blocks=64, block_size=8, max_num_batched_tokens=256, enforce_eager=not graphs)
    plain, ahead = cuda_llm(zoo, **options), cuda_llm(zoo, async_scheduling=True, **options)
    runner, checked = ahead.engine.runner, []
    launch = runner.launch

    def never_waiting(plan, previous=None):
        decoding = previous is not None and plan.seqs and all(s.num_tokens == 1 for s in plan.seqs)
        if not decoding or plan.swap_in or plan.swap_out or plan.copies:
            return launch(plan, previous)
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = launch(plan, previous)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        checked.append(plan)
        return launched

    runner.launch = never_waiting
    a = run_checked(ahead, [p for p, _ in cases], params)
    b = run_checked(plain, [p for p, _ in cases], params)
    for i in range(len(cases)):
        out_a, out_b = a[i].outputs[0], b[i].outputs[0]
        assert out_a.token_ids == out_b.token_ids, f"request {i}"
        assert (out_a.logprobs is None) == (out_b.logprobs is None)
    assert len(checked) > 10 and ahead.engine.scheduler.stats.num_preemptions > 0
