"""Engine behaviour on a real (small) model: stops, aborts, deadlines, logprobs, seeds, bad input."""

import json
import time

import pytest
import torch

from pagedserve import LLM
from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.runner.loader import UnsupportedModelError


@pytest.fixture(scope="module")
def llm(zoo):
    return LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=512, block_size=16)


def drain(engine):
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_stop_string_ends_the_sequence_without_returning_it(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = llm.generate([[30, 31, 32]], greedy, use_tqdm=False)[0].outputs[0]
    stop = full.text[10:13]
    assert stop and stop not in full.text[:10]
    cut = llm.generate([[30, 31, 32]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert llm.engine.scheduler.blocks.usage().used == 0


def test_abort_mid_generation_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("victim", list(range(20, 80)), SamplingParams(max_tokens=100, ignore_eos=True))
    engine.add_request("other", list(range(20, 40)), SamplingParams(max_tokens=5, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.blocks.usage().used > 0
    assert engine.abort("victim")
    done = drain(engine)
    assert done["victim"].outputs[0].finish_reason == "abort"
    assert done["other"].outputs[0].finish_reason == "length"
    assert engine.scheduler.blocks.usage().used == 0


def test_deadline_in_the_past_aborts(llm):
    engine = llm.engine
    engine.add_request("late", [5, 6, 7], SamplingParams(max_tokens=50), deadline=time.time() - 1)
    done = drain(engine)
    assert done["late"].outputs[0].finish_reason == "abort" and done["late"].error == "deadline exceeded"


def test_logprobs_through_the_engine_match_a_full_forward(llm, zoo):
    from transformers import AutoModelForCausalLM

    """vLLM's shapes: each position's dict holds its token (its rank in the whole vocabulary, by the
    reference's log-softmax) and the two best ranked 1 and 2; sampled, so not always the best."""
    prompt = [40, 41, 42, 43]
    params = SamplingParams(temperature=1.5, seed=5, max_tokens=8, logprobs=2, ignore_eos=True)
    completion = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(zoo.path("llama-gqa"), dtype=torch.float32)
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + completion.token_ids])).logits[0]
    ref = torch.log_softmax(logits.float(), dim=-1)
    for k, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(prompt) - 1 + k]
        assert abs(entry[token].logprob - float(row[token])) < 1e-4
        best = row.topk(2).indices.tolist()
        assert list(entry)[0] == token and {t: lp.rank for t, lp in entry.items()} == {
            token: 1 + int((row > row[token]).sum()), **{t: i + 1 for i, t in enumerate(best)}}
        assert entry[token].decoded_token == llm.tokenizer.decode([token])
    assert any(entry[token].rank > 2 for token, entry in zip(completion.token_ids, completion.logprobs))
    assert abs(completion.cumulative_logprob - sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs))) < 1e-6


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[50, 51, 52]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate([[9, 9, 9, 9], [50, 51, 52], list(range(60, 90))], [noise, seeded, noise], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


def test_n_samples_with_temperature_differ_and_share_prompt(llm):
    engine = llm.engine
    params = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=10, ignore_eos=True)
    engine.add_request("shared", list(range(20, 60)), params)  # 40 tokens: blocks 0-1 full, block 2 partial
    engine.step()  # prefill once, then fork into 4
    blocks = engine.scheduler.blocks
    tables = [blocks.block_table(s.seq_id) for s in engine.scheduler.requests["shared"].seqs]
    assert len(tables) == 4 and len({t[:3] for t in tables}) == 1  # every block of the prompt shared
    assert [blocks.gpu.ref_count(b) for b in tables[0][:2]] == [4, 4]
    assert blocks.usage().used < 4 * len(tables[0])
    out = drain(engine)["shared"]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert blocks.usage().used == 0


def test_bad_input_is_a_clear_error(llm):
    with pytest.raises(InvalidRequestError, match="maximum length"):
        llm.generate([[5] * 10], SamplingParams(max_tokens=5000), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate([[5, 10_000]], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams for"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_unsupported_architecture_names_the_supported_ones(tmp_path, zoo):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((zoo.path("llama-gqa") / name).read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(tmp_path)


def test_kv_pool_sized_from_a_byte_budget(zoo):
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", kv_cache_memory=1 << 20, block_size=16)
    # 2 layers x K,V x 16 slots x 2 kv heads x 16 dims x 4 bytes = 8 KiB per block
    assert llm.engine.scheduler.config.num_gpu_blocks == (1 << 20) // 8192


def test_generation_config_gives_the_default_sampling_params(zoo, tmp_path):
    import shutil

    path = shutil.copytree(zoo.path("llama-gqa"), tmp_path / "model")
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0, "top_k": 7}))
    defaults = LLM(path, device="cpu", dtype="float32", num_gpu_blocks=64).get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k) == (0.0, 7)
    plain = LLM(path, device="cpu", dtype="float32", num_gpu_blocks=64, generation_config="vllm").get_default_sampling_params()
    assert plain == SamplingParams()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_sampling_is_identical_across_preemption(zoo, mode):
    """A seeded request draws the same tokens whether or not it was preempted (and recomputed or
    swapped) on the way: its draws depend on (seed, output index, position) only."""
    prompts = [[30 + i, *range(40, 60)] for i in range(8)]
    params = [SamplingParams(temperature=1.0, top_k=30, seed=100 + i, max_tokens=40, ignore_eos=True, n=1 + i % 2)
              for i in range(8)]
    roomy = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=512, block_size=4)
    alone = [roomy.generate([p], q, use_tqdm=False)[0] for p, q in zip(prompts, params)]
    tight = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=40, block_size=4, num_cpu_blocks=512,
                preemption_mode=mode, max_num_batched_tokens=64)
    together = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.stats.num_preemptions > 0
    for a, b in zip(alone, together):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]


@pytest.mark.parametrize("ahead", [False, True], ids=["one_at_a_time", "async_scheduling"])
def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(zoo, ahead):
    """A fault we cannot cause for real on a CPU (out of memory on the device) is injected by
    replacing the runner's launch for one step: a mock for an unreachable fault. (A broken device
    ends the engine instead: tests/engine/test_device_failure.py.) With async scheduling the step
    that fails is launched while another runs ahead: that one's requests fail too, and no
    placeholder token (worker/core/scheduling/run_ahead.py) reaches their outputs."""
    from pagedserve.worker.core.scheduling.run_ahead import PLACEHOLDER

    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=64, async_scheduling=ahead)
    engine, real = llm.engine, llm.engine.runner.launch
    engine.add_request("victim", [20, 21, 22], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()  # its prompt: it now holds KV
    assert (engine.in_flight is not None) == ahead

    def broken(plan, previous=None):
        engine.runner.launch = real
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    engine.runner.launch = broken
    failed = {out.request_id: out for out in engine.step()}
    assert failed["victim"].finished and failed["victim"].outputs[0].finish_reason == "error"
    assert "OutOfMemoryError: CUDA out of memory" in failed["victim"].error
    assert PLACEHOLDER not in failed["victim"].outputs[0].token_ids
    engine.add_request("later", [30, 31], SamplingParams(max_tokens=3, ignore_eos=True))
    assert drain(engine)["later"].outputs[0].finish_reason == "length"  # the engine goes on
    assert engine.scheduler.blocks.usage().used == 0
    engine.scheduler.blocks.check_invariants()


def test_a_max_model_len_past_the_models_context_is_capped_with_a_warning(zoo):
    from structlog.testing import capture_logs

    from pagedserve.worker.runner.loader import inspect_model

    context = inspect_model(zoo.path("llama-gqa"), "float32").max_model_len
    blocks = -(-context // 16)  # the whole context fits the pool
    with capture_logs() as logs:
        llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=blocks, max_model_len=context * 50)
    assert llm.engine.scheduler.config.max_model_len == context
    warned = [e for e in logs if "max_model_len capped" in e["event"]]
    assert warned and warned[0]["asked"] == context * 50 and warned[0]["max_model_len"] == context
    with capture_logs() as logs:
        LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=blocks, max_model_len=context)
    assert not [e for e in logs if "max_model_len capped" in e["event"]]


def test_a_context_the_kv_budget_cannot_hold_is_refused_when_asked_and_capped_when_not(zoo):
    """As vLLM: one sequence of ``--max-model-len`` must fit the pool. Asked for, a start that cannot
    hold it is refused with the numbers and the flags; not asked for, the model's context is capped
    to what the pool holds, and the log says so and how many full-length sequences fit."""
    from structlog.testing import capture_logs

    from pagedserve.worker.setup.kv_budget import ContextDoesNotFit

    with pytest.raises(ContextDoesNotFit, match=r"max_model_len 200 needs 13 KV blocks .* holds 8 blocks \(128 "
                                                 r"tokens.*--kv-cache-memory.*--max-model-len to at most 128"):
        LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=8, max_model_len=200)
    with capture_logs() as logs:
        llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=8)
    assert llm.engine.scheduler.config.max_model_len == 128
    capped = [e for e in logs if "capped to what the KV budget holds" in e["event"]]
    assert capped and capped[0]["max_model_len"] == 128 and capped[0]["model_context"] > 128
    budget = [e for e in logs if e["event"] == "kv budget"]
    assert budget == [{**budget[0], "tokens": 128, "max_model_len": 128, "full_length_sequences": 1}]
    with capture_logs() as logs:
        LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=8, max_model_len=64)
    assert [e["full_length_sequences"] for e in logs if e["event"] == "kv budget"] == [2]


def test_loading_says_its_progress_in_the_log_where_no_terminal_shows_a_bar(zoo):
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=64)
    said = [e["tensors"] for e in logs if e["event"] == "loading weights"]
    total = said[-1].split("/")[1]
    assert len(said) == 4 and said[-1] == f"{total}/{total}"
    assert [int(s.split("/")[0]) for s in said] == sorted(int(s.split("/")[0]) for s in said)


def test_an_output_says_how_many_prompt_tokens_the_prefix_cache_served(zoo):
    """vLLM's ``num_cached_tokens``: 0 for a prompt seen first, every whole block but the one holding
    the last token for the same prompt again; the first start's count, kept through a preemption."""
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", block_size=4, num_gpu_blocks=24)
    prompt = [10 + i % 50 for i in range(30)]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    first, = llm.generate([prompt], params, use_tqdm=False)
    again, other = llm.generate([prompt, [7] * 9], params, use_tqdm=False)
    assert (first.num_cached_tokens, again.num_cached_tokens, other.num_cached_tokens) == (0, 28, 0)
    crowded = llm.generate([prompt] + [[60 + i] * 30 for i in range(3)], SamplingParams(temperature=0.0, max_tokens=20),
                           use_tqdm=False)
    assert llm.engine.stats()["num_preemptions_total"] > 0
    assert crowded[0].num_cached_tokens == 28 and [o.num_cached_tokens for o in crowded[1:]] == [0, 0, 0]


def test_an_output_names_the_stop_string_or_stop_token_that_ended_it(llm):
    """vLLM's ``stop_reason``: the matched stop string (the earliest in the text when several
    match), the stop token id, or None when the length ended it."""
    prompt = "The quick brown fox"
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    assert free.stop_reason is None and free.finish_reason == "length"
    stops = [free.text[9:11], free.text[4:6]]
    first = min(stops, key=free.text.index)
    by_string = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, stop=stops),
                             use_tqdm=False)[0].outputs[0]
    assert (by_string.finish_reason, by_string.stop_reason, by_string.text) == ("stop", first, free.text[: free.text.index(first)])
    token = free.token_ids[3]
    by_token = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[token]),
                            use_tqdm=False)[0].outputs[0]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", token)
