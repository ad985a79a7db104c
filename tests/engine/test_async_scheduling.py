"""``--async-scheduling``: step N+1 planned while step N runs (worker/core/scheduling/run_ahead.py)
gives exactly the tokens, logprobs, texts and finish reasons of one step at a time, through stops,
preemption, prefix hits, aborts, and rows that cannot run ahead mixed in."""

import itertools

import pytest

from pagedserve import LLM
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.core.scheduling.run_ahead import PLACEHOLDER


def engine_pair(zoo, **options):
    make = lambda ahead: LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", async_scheduling=ahead,  # noqa: E731
                             **{"num_gpu_blocks": 512, "block_size": 4, **options})
    return make(False), make(True)


def completions(llm, prompts, params, max_steps: int = 3000):
    """Each request's outputs as comparable tuples, the block manager checked after every step (a
    request stuck for good fails, not hangs)."""
    engine, real, steps = llm.engine, llm.engine.step, itertools.count()

    def bounded():
        assert next(steps) < max_steps, f"no end after {max_steps} steps: a request is stuck"
        outputs = real()
        engine.scheduler.blocks.check_invariants()
        return outputs

    engine.step = bounded
    try:
        return [[(o.token_ids, o.text, o.finish_reason, o.stop_reason, _logprobs(o)) for o in out.outputs]
                for out in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        del engine.step


def drain(engine, max_steps: int = 3000) -> dict:
    """Step until the engine is idle: each finished request's output (a request stuck for good fails)."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return done
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    raise AssertionError(f"no end after {max_steps} steps: a request is stuck")


def _logprobs(output):
    return None if output.logprobs is None else [{t: round(lp.logprob, 4) for t, lp in entry.items()} for entry in output.logprobs]


def counted(llm):
    """Count the steps the engine leaves running ahead (so a test cannot pass with none)."""
    engine, launches = llm.engine, []
    real = engine.scheduler.run_ahead
    engine.scheduler.run_ahead = lambda plan: (launches.append(plan), real(plan))[1]
    return launches


def plain_params(stop_text: str) -> list[SamplingParams]:
    """Rows that run ahead: greedy and seeded, EOS, stop strings and stop ids, logprobs, min_tokens,
    max_tokens of 1, penalties (their history's last token a placeholder, filled on the device)."""
    return [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=25, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_text], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=20, stop_token_ids=[50, 51, 52]),
        SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3),
        SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.6, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=5, max_tokens=30, presence_penalty=1.5, frequency_penalty=1.0,
                       ignore_eos=True),
    ]


# rows whose steps run one at a time (forks, beams, prompt logprobs)
ONE_AT_A_TIME = [
    SamplingParams(temperature=0.7, seed=11, n=2, max_tokens=10),
    SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=1),
    SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=8),
]


@pytest.mark.parametrize("mixed", [False, True], ids=["ahead", "mixed"])
def test_running_ahead_gives_the_tokens_of_one_step_at_a_time(zoo, mixed):
    """Chunked prompts, stops of every kind, logprobs, seeds; mixed with rows that cannot run ahead
    (their steps run one at a time, the others' before and after them run ahead)."""
    plain, ahead = engine_pair(zoo, max_num_batched_tokens=32)
    first = plain.generate([[32, *range(40, 46)]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                           use_tqdm=False)
    stop_text = first[0].outputs[0].text[12:15]
    params = (plain_params(stop_text) + (ONE_AT_A_TIME if mixed else [])) * 2
    prompts = [[30 + i, *range(40, 40 + 3 * i)] for i in range(len(params))]
    launches, ahead_steps = [], counted(ahead)
    real = ahead.engine.runner.launch
    ahead.engine.runner.launch = lambda plan, previous=None: (launches.append(plan), real(plan, previous))[1]
    expected = completions(plain, prompts, params)
    assert completions(ahead, prompts, params) == expected
    assert len(ahead_steps) > (0.1 if mixed else 0.8) * len(launches)
    assert any(out[0][2] == "stop" and out[0][3] == stop_text for out in expected)
    for llm in (plain, ahead):
        assert llm.engine.scheduler.blocks.usage().used == 0 and not llm.engine.has_unfinished()
        llm.engine.scheduler.blocks.check_invariants()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_rows_running_ahead_keep_their_tokens(zoo, mode):
    """A request preempted while its token runs ahead (recomputed with it, or swapped out with its
    KV) goes on with the same tokens as one step at a time; seeded draws included."""
    options = dict(num_gpu_blocks=40, num_cpu_blocks=512, preemption_mode=mode, max_num_batched_tokens=64)
    plain, ahead = engine_pair(zoo, **options)
    prompts = [[30 + i, *range(40, 60)] for i in range(8)]
    params = [SamplingParams(temperature=1.0 if i % 2 else 0.0, top_k=30, seed=100 + i, max_tokens=40, ignore_eos=True)
              for i in range(8)]
    launches = counted(ahead)
    assert completions(ahead, prompts, params) == completions(plain, prompts, params)
    assert ahead.engine.scheduler.stats.num_preemptions > 0 and launches
    ahead.engine.scheduler.blocks.check_invariants()


def test_prefix_hits_on_blocks_published_while_running_ahead(zoo):
    """Blocks are published when their step is launched: a request arriving later hits them, and its
    tokens are those of one step at a time."""
    plain, ahead = engine_pair(zoo, block_size=4)
    base = list(range(60, 90))
    results = []
    for llm in (plain, ahead):
        engine = llm.engine
        engine.add_request("first", base, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        for _ in range(4):
            engine.step()
        engine.add_request("second", base + [5, 6], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        done = drain(engine)
        results.append({k: (o.outputs[0].token_ids, o.num_cached_tokens) for k, o in done.items()})
    assert results[0] == results[1] and results[1]["second"][1] >= 28


def test_an_abort_while_a_token_runs_ahead_never_shows_its_placeholder(zoo):
    _, ahead = engine_pair(zoo)
    engine = ahead.engine
    engine.add_request("victim", list(range(20, 40)), SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    engine.add_request("other", list(range(20, 30)), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    seen = {}
    for _ in range(4):
        seen.update((o.request_id, o) for o in engine.step())
    assert engine.in_flight is not None and engine.in_flight.ahead
    assert engine.abort("victim")
    done = drain(engine)
    victim = done["victim"].outputs[0]
    assert victim.finish_reason == "abort" and PLACEHOLDER not in victim.token_ids
    assert victim.token_ids[: len(seen["victim"].outputs[0].token_ids)] == seen["victim"].outputs[0].token_ids
    assert len(done["other"].outputs[0].token_ids) == 6
    assert engine.scheduler.blocks.usage().used == 0


def test_a_steps_time_covers_its_launch_both_ways(zoo):
    """The step-time fits (--max-step-ms) read each step's time: the longest step read is never shorter
    than the longest launch (the prompt's) took on the host (a clock started after the launch read
    almost nothing for every step one at a time)."""
    for llm in engine_pair(zoo):
        engine, launched, read = llm.engine, [], []
        real = engine.runner.launch
        engine.runner.launch = lambda plan, previous=None: launched.append(real(plan, previous)) or launched[-1]
        engine.add_request("a", list(range(20, 400)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
            read.append(engine.last_forward.seconds if engine.last_forward else 0.0)
        assert max(read) >= max(step.timer.host_seconds for step in launched) > 0


def test_speculative_decoding_keeps_async_scheduling_off_and_says_so(zoo):
    """Drafts need each token on the host (n-gram lookup reads the history), so an engine with both
    runs one step at a time, says why in its log, and serves as it would without the flag."""
    from structlog.testing import capture_logs

    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with capture_logs() as logs:
        both = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=256, async_scheduling=True,
                   speculative_config=spec)
    assert not both.engine.runs_ahead
    assert any(e["event"].startswith("async scheduling is off") and e["because"] == "speculative decoding" for e in logs)
    plain = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=256, speculative_config=spec)
    prompts, params = [[5, 6, 7, 8] * 4, list(range(30, 45))], SamplingParams(temperature=0.0, max_tokens=16)
    assert completions(both, prompts, [params] * 2) == completions(plain, prompts, [params] * 2)
