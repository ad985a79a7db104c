"""Scheduler behaviour on exact scenarios, driven by the paged KV simulator."""

import pytest

from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.core.scheduling.config import SchedulerConfig
from pagedserve.worker.core.scheduling.request import FinishReason, RequestStatus
from pagedserve.worker.core.scheduling.scheduler import Scheduler
from tests.kv_simulator import KVSimulator, reference_output


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make(num_blocks=32, block_size=4, clock=None, **kw):
    cfg = SchedulerConfig(num_gpu_blocks=num_blocks, block_size=block_size, **kw)
    sched = Scheduler(cfg, eos_token_ids=frozenset(), clock=clock or Clock())
    return sched, KVSimulator(block_size, num_blocks, cfg.num_cpu_blocks)


def step(sched, sim):
    plan = sched.schedule()
    assert plan.num_tokens <= sched.config.max_num_batched_tokens, "the token budget was exceeded"
    out = sched.update(plan, sim.execute(plan))
    sched.blocks.check_invariants()
    assert sched.num_running_seqs <= sched.config.max_num_seqs
    return plan, out


def params(max_tokens=4, **kw):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def test_chunked_prefill_mixes_with_decodes():
    sched, sim = make(max_num_batched_tokens=8)
    sched.add("a", list(range(3)), params(max_tokens=5))
    plan, _ = step(sched, sim)
    assert [(s.request_id, s.num_tokens, s.num_samples) for s in plan.seqs] == [("a", 3, 1)]
    sched.add("b", list(range(20)), params())
    plan, _ = step(sched, sim)
    # a decodes (1 token), b takes the remaining 7 of the budget
    assert [(s.request_id, s.start, s.num_tokens, s.num_samples) for s in plan.seqs] == [("a", 3, 1, 1), ("b", 0, 7, 0)]
    plan, _ = step(sched, sim)
    assert [(s.request_id, s.start, s.num_tokens) for s in plan.seqs] == [("a", 4, 1), ("b", 7, 7)]
    plan, _ = step(sched, sim)
    assert [(s.request_id, s.start, s.num_tokens, s.num_samples) for s in plan.seqs] == [("a", 5, 1, 1), ("b", 14, 6, 1)]
    first = plan.seqs[0]
    assert first.slot_mapping(4, sim.tables[first.seq_id][0])[:1] == [sched.blocks.block_table(0)[1] * 4 + 1]


def test_max_num_seqs_holds_requests_back():
    sched, sim = make(max_num_seqs=2)
    for rid in "abc":
        sched.add(rid, [1, 2], params())
    plan, _ = step(sched, sim)
    assert {s.request_id for s in plan.seqs} == {"a", "b"}
    assert sched.requests["c"].status is RequestStatus.WAITING


def test_n_greater_than_one_prefills_once_and_forks():
    sched, sim = make()
    sched.add("a", list(range(6)), params(max_tokens=3, n=3))
    plan, out = step(sched, sim)
    assert [(s.num_tokens, s.num_samples) for s in plan.seqs] == [(6, 3)]
    assert out[0].request_id == "a" and len(out[0].outputs) == 3
    req = sched.requests["a"]
    assert len(req.seqs) == 3
    tables = [sched.blocks.block_table(s.seq_id) for s in req.seqs]
    assert tables[0] == tables[1] == tables[2] == (0, 1)
    assert sched.blocks.gpu.ref_count(0) == 3
    plan, _ = step(sched, sim)
    assert len(plan.copies) == 2  # the shared partial block is copied for two of the three forks
    while sched.has_work:
        step(sched, sim)
    for seq in req.seqs:
        assert seq.output_ids == reference_output(list(range(6)), seq.index, 3, None)
    assert sched.blocks.num_free_blocks == 32


def test_preemption_takes_the_lowest_priority_latest_request():
    sched, sim = make(num_blocks=6, block_size=2)
    sched.add("low", [1, 2, 3], params(max_tokens=6), priority=5)
    sched.add("high", [4, 5, 6], params(max_tokens=6), priority=0)
    sched.add("mid", [7, 8, 9], params(max_tokens=6), priority=1)
    step(sched, sim)
    assert {r.request_id for r in sched.running} == {"low", "high", "mid"}
    preempted = None
    while preempted is None:
        plan, _ = step(sched, sim)
        if plan.num_preempted:
            preempted = [r.request_id for r in sched.waiting]
    assert preempted == ["low"]
    while sched.has_work:
        step(sched, sim)
    assert sched.stats.num_preemptions >= 1


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_request_resumes_with_identical_output(mode):
    sched, sim = make(num_blocks=8, block_size=2, num_cpu_blocks=16, preemption_mode=mode)
    prompts = {f"r{i}": [i, i + 1, i + 2, i + 3, i + 4] for i in range(4)}
    for rid, prompt in prompts.items():
        sched.add(rid, prompt, params(max_tokens=6))
    outputs, saw_swap, preempted = {}, False, 0
    while sched.has_work:
        plan, out = step(sched, sim)
        saw_swap |= bool(plan.swap_out)
        preempted += plan.num_preempted
        outputs.update({r.request_id: r.outputs[0].token_ids for r in out if r.finished})
    assert sched.stats.num_preemptions == preempted > 1
    assert saw_swap == (mode == "swap")
    for rid, prompt in prompts.items():
        assert outputs[rid] == reference_output(prompt, 0, 6, None)


def test_deadline_aborts_and_frees():
    clock = Clock()
    sched, sim = make(clock=clock)
    sched.add("late", [1, 2, 3], params(max_tokens=10), deadline=5.0)
    step(sched, sim)
    assert sched.blocks.usage().used == 1
    clock.now = 5.0
    plan, out = step(sched, sim)
    assert plan.seqs == ()
    assert out[0].request_id == "late" and out[0].outputs[0].finish_reason == FinishReason.ABORT.value
    assert out[0].error == "deadline exceeded"
    assert sched.blocks.usage().used == 0


def test_abort_in_every_state():
    sched, sim = make(num_blocks=6, block_size=2, num_cpu_blocks=8, preemption_mode="swap", max_num_seqs=2)
    sched.add("a", [1, 2, 3, 4], params(max_tokens=8))
    sched.add("b", [5, 6, 7, 8], params(max_tokens=8))
    sched.add("c", [9], params())
    states = {}
    while not states.get("swapped"):
        step(sched, sim)
        for r in sched.swapped:
            states["swapped"] = r.request_id
    assert sched.requests["c"].status is RequestStatus.WAITING
    running = sched.running[0].request_id
    for rid in ("c", states["swapped"], running):
        assert sched.abort(rid)
        sched.blocks.check_invariants()
    assert not sched.abort("c") and not sched.abort("nope")
    _, out = step(sched, sim)
    assert {r.request_id for r in out} == {"a", "b", "c"}
    assert all(o.finish_reason == FinishReason.ABORT.value for r in out for o in r.outputs)
    assert sched.blocks.num_free_blocks == 6 and sched.blocks.cpu.num_free == 8


def test_requests_that_can_never_fit_are_rejected():
    sched, _ = make(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="maximum length"):
        sched.add("long", list(range(60)), params(max_tokens=8))
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        sched.add("big", list(range(10)), params(max_tokens=10))
    with pytest.raises(InvalidRequestError, match="empty"):
        sched.add("empty", [], params())
    sched.add("ok", [1], params())
    with pytest.raises(InvalidRequestError, match="already in flight"):
        sched.add("ok", [1], params())


def test_prefix_hits_are_counted_and_shared():
    sched, sim = make(block_size=4)
    system = list(range(40, 52))
    sched.add("a", system + [1], params(max_tokens=2))
    while sched.has_work:
        step(sched, sim)
    sched.add("b", system + [2], params(max_tokens=2))
    plan, _ = step(sched, sim)
    assert plan.seqs[0].start == 12 and plan.seqs[0].num_tokens == 1
    assert sched.stats.prefix_hit_tokens == 12
    while sched.has_work:
        step(sched, sim)
    assert sched.blocks.usage().cached == 3


def test_stop_token_and_min_tokens():
    sched, sim = make()
    prompt = [3, 1, 4]
    first = reference_output(prompt, 0, 1, None)[0]
    sched.add("stop", prompt, SamplingParams(max_tokens=5, stop_token_ids=[first]))
    sched.add("min", prompt, SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=[first]))
    done = {}
    while sched.has_work:
        _, out = step(sched, sim)
        done.update({r.request_id: r.outputs[0] for r in out if r.finished})
    assert done["stop"].token_ids == [first] and done["stop"].finish_reason == FinishReason.STOP.value
    assert done["min"].token_ids == reference_output(prompt, 0, 5, eos=first, min_tokens=2)
    assert done["min"].finish_reason == (FinishReason.STOP.value if done["min"].token_ids[-1] == first else FinishReason.LENGTH.value)


def test_abort_with_an_error_reports_it():
    sched, sim = make()
    sched.add("bad", [1, 2, 3], params())
    step(sched, sim)
    assert sched.abort("bad", error="the engine step failed")
    _, out = step(sched, sim)
    assert out[0].error == "the engine step failed"
    assert out[0].outputs[0].finish_reason == FinishReason.ERROR.value


def test_one_preemption_is_counted_once():
    """Two requests that fit alone but not together: exactly one preemption, in the plan and in the stats."""
    sched, sim = make(num_blocks=4, block_size=2, max_num_seqs=2)
    sched.add("first", [1, 2], params(max_tokens=5))  # needs 4 blocks at its end
    sched.add("second", [3, 4], params(max_tokens=5))
    preempted = []
    while sched.has_work:
        plan, _ = step(sched, sim)
        preempted.append(plan.num_preempted)
    assert sum(preempted) == sched.stats.num_preemptions == max(preempted) == 1


def test_the_plan_carries_what_the_runner_needs_to_sample():
    sched, sim = make()
    sched.add("plain", [1, 2, 3], params(max_tokens=3))
    sched.add("penalised", [4, 5], params(max_tokens=3, repetition_penalty=1.2))
    sched.add("forked", [6, 7, 8], params(max_tokens=3, n=2))
    sched.add("beams", [9, 10], SamplingParams(use_beam_search=True, beam_width=2, max_tokens=3, temperature=0.0))
    plan = sched.schedule()
    by_id = {s.request_id: s for s in plan.seqs}
    assert by_id["plain"].params is sched.requests["plain"].params
    assert (by_id["plain"].prompt_ids, by_id["plain"].output_ids, by_id["plain"].beam_group) == ((), (), ())
    assert by_id["penalised"].prompt_ids == (4, 5) and by_id["penalised"].output_ids == ()
    assert by_id["forked"].num_samples == 2 and by_id["plain"].num_samples == 1
    assert by_id["beams"].beam_group == tuple(s.seq_id for s in sched.requests["beams"].live_seqs)
    sched.update(plan, sim.execute(plan))
    plan = sched.schedule()
    later = [s for s in plan.seqs if s.request_id == "penalised"][0]
    assert later.num_output == 1 and later.output_ids == tuple(sched.requests["penalised"].seqs[0].output_ids)
    forks = sorted((s.seq_index, s.num_output) for s in plan.seqs if s.request_id == "forked")
    assert forks == [(0, 1), (1, 1)]


def test_duplicate_ids_and_tenant_salts():
    sched, sim = make(block_size=4)
    sched.add("a", list(range(1, 10)), params(), extra_key="tenant-1")
    with pytest.raises(InvalidRequestError) as err:
        sched.add("a", [1], params())
    assert err.value.field == "id"
    while sched.has_work:
        step(sched, sim)
    sched.add("same-tenant", list(range(1, 10)), params(), extra_key="tenant-1")
    sched.add("other-tenant", list(range(1, 10)), params(), extra_key="tenant-2")
    step(sched, sim)
    assert sched.stats.prefix_hit_tokens == 8  # two full blocks, for the same tenant only
    assert sched.stats.prefix_query_tokens == 9 * 3


def test_waiting_requests_share_one_token_budget():
    sched, sim = make(max_num_batched_tokens=10)
    sched.add("a", list(range(1, 7)), params())  # 6 tokens
    sched.add("b", list(range(10, 20)), params())  # 10 tokens: 4 fit this step
    plan, _ = step(sched, sim)
    assert [(s.request_id, s.num_tokens) for s in plan.seqs] == [("a", 6), ("b", 4)]


@pytest.mark.parametrize("cpu_blocks, status", [(2, RequestStatus.SWAPPED), (1, RequestStatus.WAITING)])
def test_swap_preemption_uses_a_cpu_pool_that_fits_exactly(cpu_blocks, status):
    """The victim needs 2 CPU blocks: a pool of exactly 2 takes it, a pool of 1 falls back to recompute."""
    sched, sim = make(num_blocks=4, block_size=2, num_cpu_blocks=cpu_blocks, preemption_mode="swap", max_num_seqs=2)
    sched.add("first", [1, 2], params(max_tokens=5))
    sched.add("second", [3, 4], params(max_tokens=5))
    victims = []
    while sched.has_work:
        plan, _ = step(sched, sim)
        if plan.num_preempted:
            victims += [r.status for r in (*sched.swapped, *sched.waiting)]
    assert victims == [status]


def test_the_next_plan_names_the_requests_that_ended():
    sched, sim = make()
    sched.add("a", [1, 2], params(max_tokens=1))
    sched.add("b", [3, 4], params(max_tokens=8))
    step(sched, sim)  # a finishes (one token)
    assert sched.abort("b")
    plan = sched.schedule()
    assert sorted(plan.finished_request_ids) == ["a", "b"]
    assert sched.schedule().finished_request_ids == ()  # said once


def test_no_waiting_request_is_admitted_while_one_is_swapped_out():
    sched, sim = make(num_blocks=4, block_size=2, num_cpu_blocks=8, preemption_mode="swap", max_num_seqs=3)
    sched.add("first", [1, 2], params(max_tokens=5))
    sched.add("second", [3, 4], params(max_tokens=5))
    while not sched.swapped:
        step(sched, sim)
    sched.add("third", [5], params(max_tokens=1))
    while sched.swapped:
        step(sched, sim)
        if sched.swapped:
            assert sched.requests["third"].status is RequestStatus.WAITING


def test_queue_time_is_from_arrival_to_the_first_step_that_runs_it():
    clock = Clock()
    sched, sim = make(clock=clock, max_num_seqs=1)
    sched.add("first", [1, 2], params(max_tokens=3))
    sched.add("second", [3, 4], params(max_tokens=3))
    clock.now = 1.0
    _, out = step(sched, sim)
    assert {o.request_id: o.queued_s for o in out} == {"first": 1.0}
    for _ in range(6):  # "first" runs its three tokens, then "second" gets the one slot
        clock.now += 1.0
        _, out = step(sched, sim)
        queued = {o.request_id: o.queued_s for o in out}
        assert queued.get("first", 1.0) == 1.0  # fixed once it ran, not growing
        if "second" in queued:
            assert queued["second"] > 1.0  # it waited behind "first"
            return
    raise AssertionError("the second request never ran")


def test_a_request_waits_for_its_grammar_and_others_pass_it():
    """A structured request stays queued while its grammar compiles (a Future); requests behind it
    start meanwhile; a grammar that failed ends its request with the reason."""
    from concurrent.futures import Future

    sched, sim = make()
    compiling, broken = Future(), Future()
    sched.add("slow", [1, 2], params(), grammar=compiling)
    sched.add("free", [3, 4], params())
    sched.add("bad", [5, 6], params(), grammar=broken)
    broken.set_exception(ValueError("unsupported keyword"))
    plan, outs = step(sched, sim)
    assert [s.request_id for s in plan.seqs] == ["free"] and sched.compiling() == [compiling]
    assert [(o.request_id, o.error) for o in outs if o.finished] == [("bad", "structured output: unsupported keyword")]
    step(sched, sim)
    compiling.set_result(None)  # a real engine sets a pristine matcher; None is "ready" to the queue
    sched.requests["slow"].grammar = None
    plan, _ = step(sched, sim)
    assert "slow" in [s.request_id for s in plan.seqs]


def test_a_long_prompt_waits_until_its_whole_prompt_fits_beside_the_running_ones():
    """Two prompts of 10 blocks in a pool of 16: the second's first chunk fits while the first one
    decodes, but not its whole prompt; it waits for the first to end instead of being admitted,
    growing and preempted (or preempting) before its prompt is in."""
    sched, sim = make(num_blocks=16, max_num_batched_tokens=8)
    prompts = {"a": list(range(40)), "b": list(range(100, 140))}
    for rid, prompt in prompts.items():
        sched.add(rid, prompt, params(max_tokens=12))
    outputs = {}
    while sched.has_work:
        plan, out = step(sched, sim)
        assert {s.request_id for s in plan.seqs} != {"a", "b"}, "both ran at once"
        outputs.update((o.request_id, o.outputs[0].token_ids) for o in out if o.finished)
    assert sched.stats.num_preemptions == 0
    for rid, prompt in prompts.items():
        assert outputs[rid] == reference_output(prompt, 0, 12, None)
