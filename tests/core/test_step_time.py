"""Prefill chunks sized by time (``max_step_ms``, worker/core/scheduling/step_time.py): the step-time fit
recovers what a step costs, and the real scheduler, given a fit (a fake clock: no step is timed here),
cuts a long prompt's chunks beside decoding streams so that every step stays within the target, the
later chunks (attending over more context) smaller, every stream still getting its token each step;
a lone prompt's chunks are as large as the token budget allows."""

from __future__ import annotations

import random

import pytest

from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.core.scheduling.config import SchedulerConfig
from pagedserve.worker.core.scheduling.scheduler import Scheduler
from pagedserve.worker.core.scheduling import step_time
from pagedserve.worker.core.scheduling.step_time import STEP_BUCKETS, PrefillBudget, StepSeconds, StepTime, pairs
from tests.kv_simulator import KVSimulator

COST = (0.01, 1e-4, 2e-8)  # seconds: fixed, per token, per query-key pair


def fitted(fixed: float, per_token: float, per_pair: float) -> StepTime:
    fit, rng = StepTime(), random.Random(0)
    for _ in range(40):
        tokens, attended = rng.randint(1, 2048), rng.uniform(0, 1e7)
        fit.observe(tokens, attended, fixed + per_token * tokens + per_pair * attended)
    return fit


def test_the_fit_recovers_a_steps_parts_and_waits_until_it_can_tell_them_apart():
    assert fitted(*COST).coefficients() == pytest.approx(COST, rel=1e-6)
    alike = StepTime()
    for _ in range(20):
        alike.observe(64, 5000.0, 0.02)  # one kind of step: the parts cannot be told apart
    assert alike.coefficients() is None and StepTime().chunk(0.01, 0, 100) == 100  # not priced: no cut
    fit = fitted(*COST)
    most = fit.chunk(0.03, 4000, 2048)
    assert fit.chunk_seconds(4000, most) <= 0.03 < fit.chunk_seconds(4000, most + 1)
    assert fit.chunk(10.0, 4000, 2048) == 2048 and fit.chunk(0.0, 4000, 2048) == 0



def test_older_steps_fade_so_the_fit_follows_a_step_time_that_changed():
    """The fit is a ``DecayedFit``: a step 0.98 ** 300 steps old weighs nothing beside today's."""
    fit, rng = fitted(*COST), random.Random(1)
    for _ in range(300):  # the machine got twice as slow (another process, a thermal limit)
        tokens, attended = rng.randint(1, 2048), rng.uniform(0, 1e7)
        fit.observe(tokens, attended, 2 * (COST[0] + COST[1] * tokens + COST[2] * attended))
    assert fit.coefficients() == pytest.approx(tuple(2 * part for part in COST), rel=1e-2)
    assert fit.seen.weight == pytest.approx(1 / (1 - 0.98), rel=1e-2)

def run_streams_and_a_long_prompt(max_step_ms: float | None, streams: int = 8, long: int = 7000):
    """``streams`` requests decoding, then a ``long`` prompt: each step's plan while it prefills."""
    cfg = SchedulerConfig(num_gpu_blocks=1200, block_size=16, max_num_batched_tokens=2048, max_model_len=8192,
                          max_step_ms=max_step_ms)
    sched = Scheduler(cfg)
    if sched.step_time is not None:
        sched.step_time = fitted(*COST)
    sim = KVSimulator(16, 1200, 0)
    for i in range(streams):
        sched.add(f"s{i}", [1 + (i * 7 + k) % 90 for k in range(32)], SamplingParams(max_tokens=1000, ignore_eos=True))
    for _ in range(2):  # their prompts in, every stream decoding
        plan = sched.schedule()
        sched.update(plan, sim.execute(plan))
    sched.add("long", [1 + k % 90 for k in range(long)], SamplingParams(max_tokens=1, ignore_eos=True))
    plans = []
    while "long" in sched.requests and sched.requests["long"].seqs[0].num_computed < long:
        plan = sched.schedule()
        plans.append(plan)
        sched.update(plan, sim.execute(plan))
        assert len(plans) < 500
    return plans


def test_a_long_prompt_beside_streams_is_cut_to_the_step_time_and_every_stream_moves_every_step():
    plans = run_streams_and_a_long_prompt(max_step_ms=50)
    fit = fitted(*COST)
    chunks = [next(s for s in plan.seqs if s.request_id == "long") for plan in plans]
    for plan in plans:
        assert sum(1 for s in plan.seqs if s.request_id != "long") == 8  # no stream waits for the prompt
        seconds = fit.seconds(plan.num_tokens, sum(pairs(s.start, s.num_tokens) for s in plan.seqs))
        assert seconds <= 0.050 + 1e-9, seconds
    sizes = [c.num_tokens for c in chunks]
    assert sizes[0] > sizes[-2] and sizes == sorted(sizes[:-1], reverse=True) + sizes[-1:]  # smaller as context grows
    assert 150 < sizes[-2] < sizes[0] < 2048 and sum(sizes) == 7000 - chunks[0].start  # (a prefix hit: a stream's prompt)


def test_without_a_target_or_without_streams_chunks_take_the_token_budget():
    plain = run_streams_and_a_long_prompt(max_step_ms=None)
    alone = run_streams_and_a_long_prompt(max_step_ms=50, streams=0)
    for plans in (plain, alone):
        sizes = [next(s for s in plan.seqs if s.request_id == "long").num_tokens for plan in plans]
        assert sizes[0] >= 2048 - 8 and len(plans) <= 4, sizes  # 7000 tokens in chunks of (nearly) the budget


def test_where_decoding_alone_nears_the_target_a_prompt_still_gets_as_much_time_as_the_streams():
    """A large batch (or model) whose decoding rows alone take longer than the target: each step's
    prefill chunk gets the rows' own time, not ``MIN_PREFILL`` tokens (new requests would starve
    behind the running ones); with room under the target, what the target leaves."""
    fit = fitted(*COST)
    starts = [3000] * 64
    decoding = fit.seconds(64, sum(pairs(start, 1) for start in starts))
    assert decoding > 0.012  # 17.8 ms: past a 12 ms target by itself
    crowded = PrefillBudget.beside(fit, 12, starts)
    assert crowded.seconds_left == pytest.approx(decoding)
    tokens = crowded.cut(0, 2000)
    assert fit.chunk_seconds(0, tokens) <= decoding < fit.chunk_seconds(0, tokens + 1) and tokens > 50
    roomy = PrefillBudget.beside(fit, 100, starts)
    assert roomy.seconds_left == pytest.approx(0.1 - decoding)


def test_after_decoding_alone_a_prompts_chunks_grow_from_the_steps_the_fit_has_seen():
    """The fit is trusted up to twice the largest step seen lately: after a stretch of 8-token
    decoding steps, a prompt beside them starts at ``UNPRICED_PREFILL`` tokens and each chunk at most
    doubles the last step, however much time the target leaves (a first chunk priced far from the
    fit's data missed its target by a quarter)."""
    fit = fitted(*COST)
    cost = lambda tokens, attended: COST[0] + COST[1] * tokens + COST[2] * attended  # noqa: E731
    for _ in range(60):
        fit.observe(8, 8 * 3000, cost(8, 8 * 3000))
    assert fit.trusted() == step_time.UNPRICED_PREFILL
    sizes, start = [], 0
    for _ in range(5):
        tokens = PrefillBudget.beside(fit, 1000, [3000] * 8).cut(start, 7000)  # a second: time never binds here
        sizes.append(tokens)
        fit.observe(tokens + 8, pairs(start, tokens) + 8 * 3000, cost(tokens + 8, pairs(start, tokens) + 8 * 3000))
        start += tokens
    assert sizes == [128, 272, 560, 1136, 2288], sizes


def test_until_the_fit_prices_a_step_a_prompt_beside_streams_moves_in_small_chunks():
    """The fit learns from the steps themselves: until it can tell their parts apart, a chunk beside
    decoding rows carries ``UNPRICED_PREFILL`` tokens at most (a first chunk of the whole budget would
    be the pause the target is there to prevent)."""
    cfg = SchedulerConfig(num_gpu_blocks=400, block_size=16, max_num_batched_tokens=2048, max_step_ms=50)
    sched = Scheduler(cfg)
    sim = KVSimulator(16, 400, 0)
    sched.add("stream", [5] * 20, SamplingParams(max_tokens=100, ignore_eos=True))
    plan = sched.schedule()
    sched.update(plan, sim.execute(plan))
    sched.add("long", [7] * 1000, SamplingParams(max_tokens=1, ignore_eos=True))
    plan = sched.schedule()
    assert [s.num_tokens for s in plan.seqs] == [1, step_time.UNPRICED_PREFILL]


def test_long_prompts_beside_streams_share_the_prefill_time_and_a_higher_priority_goes_first():
    """Two long prompts of one priority move together, each step's prefill time split between them
    (not the first taking it all, the second 16 tokens); a prompt of a higher priority still takes
    what it can use first."""
    cfg = SchedulerConfig(num_gpu_blocks=2400, block_size=16, max_num_batched_tokens=2048, max_model_len=8192,
                          max_step_ms=50)
    sched, sim = Scheduler(cfg), KVSimulator(16, 2400, 0)
    sched.step_time = fitted(*COST)
    for i in range(8):
        sched.add(f"s{i}", [1 + (i * 7 + k) % 90 for k in range(32)], SamplingParams(max_tokens=1000, ignore_eos=True))
    for name, priority in (("a", 0), ("b", 0)):
        sched.add(name, [1 + k % 89 for k in range(7000)], SamplingParams(max_tokens=1, ignore_eos=True), priority=priority)

    def chunks(steps: int) -> list[dict[str, int]]:
        seen = []
        for _ in range(steps):
            plan = sched.schedule()
            seen.append({s.request_id: s.num_tokens for s in plan.seqs if s.num_tokens > 1})
            sched.update(plan, sim.execute(plan))
        return seen

    shared = chunks(6)[2:]  # both running (the first steps admit them)
    assert all({"a", "b"} <= set(step) for step in shared), shared
    assert all(min(step["a"], step["b"]) > 0.6 * max(step["a"], step["b"]) for step in shared), shared
    sched.add("urgent", [2 + k % 80 for k in range(7000)], SamplingParams(max_tokens=1, ignore_eos=True), priority=-1)
    first = chunks(4)[2:]
    assert all(step["urgent"] > 4 * max(step.get("a", 0), step.get("b", 0)) for step in first), first


def test_every_steps_seconds_count_into_cumulative_buckets_as_prometheus_reads_them():
    seconds = StepSeconds()
    for value in (0.004, 0.005, 0.3, 0.3, 20.0):  # a bound counts in its own bucket; past the last, only in the count
        seconds.observe(value)
    snap = seconds.snapshot("steps")
    assert snap == {**{f"steps_le_{bound:g}": float(sum(value <= bound for value in (0.004, 0.005, 0.3, 0.3, 20.0)))
                       for bound in STEP_BUCKETS}, "steps_count": 5.0, "steps_sum": pytest.approx(20.609)}
    assert snap["steps_le_0.005"] == 2.0 and snap["steps_le_0.25"] == 2.0 and snap["steps_le_0.5"] == 4.0
    assert list(seconds.snapshot())[0] == "engine_step_seconds_le_0.005"


def test_a_burst_of_prompts_beside_streams_starts_a_few_at_a_time_in_order_within_the_target():
    """Forty prompts at once beside decoding streams: once a step's prefill time is spent, a new prompt
    starts only beside fewer than ``PREFILLING_AT_ONCE`` others (sharing the step's time), so they start
    in order, finish nearly so, and the steps keep to the target. Before, every one started with ``MIN_PREFILL`` tokens in the first
    step (40 x 16 tokens past the target: a W64 batch's steps ran 0.5-0.7 s at 300 ms) and all
    finished late together."""
    cfg = SchedulerConfig(num_gpu_blocks=2400, block_size=16, max_num_batched_tokens=2048, max_model_len=8192,
                          max_step_ms=50)
    sched, sim = Scheduler(cfg), KVSimulator(16, 2400, 0)
    sched.step_time = fit = fitted(*COST)
    for i in range(8):
        sched.add(f"s{i}", [1 + (i * 7 + k) % 90 for k in range(32)], SamplingParams(max_tokens=1000, ignore_eos=True))
    for _ in range(2):
        plan = sched.schedule()
        sched.update(plan, sim.execute(plan))
    rng = random.Random(2)
    for i in range(40):  # no two share a prefix
        sched.add(f"p{i}", [rng.randint(100, 30000) for _ in range(600)], SamplingParams(max_tokens=1, ignore_eos=True))
    done, prefilling, started = [], [], {}
    while len(done) < 40:
        plan = sched.schedule()
        prompts = [s for s in plan.seqs if s.request_id.startswith("p")]
        prefilling.append(len(prompts))
        for s in prompts:
            started.setdefault(int(s.request_id[1:]), len(prefilling))
        seconds = fit.seconds(plan.num_tokens, sum(pairs(s.start, s.num_tokens) for s in plan.seqs))
        assert seconds <= 0.050 + step_time.PREFILLING_AT_ONCE * fit.chunk_seconds(600, step_time.MIN_PREFILL), seconds
        for out in sched.update(plan, sim.execute(plan)):
            if out.request_id.startswith("p") and out.finished:
                done.append(int(out.request_id[1:]))
        assert len(prefilling) < 500
    assert max(prefilling) <= step_time.PREFILLING_AT_ONCE + 2, prefilling
    assert list(started) == sorted(started), started  # started in the order they came
    assert all(abs(place - i) < step_time.PREFILLING_AT_ONCE for place, i in enumerate(done)), done  # done so, nearly


def test_a_more_urgent_prompt_starts_at_once_beside_a_burst_of_less_urgent_ones():
    cfg = SchedulerConfig(num_gpu_blocks=2400, block_size=16, max_num_batched_tokens=2048, max_model_len=8192,
                          max_step_ms=50)
    sched, sim = Scheduler(cfg), KVSimulator(16, 2400, 0)
    sched.step_time = fitted(*COST)
    sched.add("s", [5] * 32, SamplingParams(max_tokens=1000, ignore_eos=True))
    for _ in range(2):
        plan = sched.schedule()
        sched.update(plan, sim.execute(plan))
    rng = random.Random(3)
    for i in range(12):
        sched.add(f"p{i}", [rng.randint(100, 30000) for _ in range(3000)], SamplingParams(max_tokens=1, ignore_eos=True))
    for _ in range(3):  # the burst's first few running
        plan = sched.schedule()
        sched.update(plan, sim.execute(plan))
    assert sum(1 for r in sched.running if r.prefilling) == step_time.PREFILLING_AT_ONCE
    sched.add("urgent", [rng.randint(100, 30000) for _ in range(3000)], SamplingParams(max_tokens=1, ignore_eos=True),
              priority=-1)
    plan = sched.schedule()
    assert "urgent" in {s.request_id for s in plan.seqs}
    assert not any(s.request_id == f"p{step_time.PREFILLING_AT_ONCE}" for s in plan.seqs)  # the next of the burst waits
