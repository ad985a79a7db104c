"""Many requests through a pool far too small: everything finishes, correctly, and nothing leaks."""

import random

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from shared.sampling import SamplingParams
from tests.kv_simulator import KVSimulator, reference_output
from worker.core.config import SchedulerConfig
from worker.core.request import FinishReason
from worker.core.scheduler import Scheduler

EOS = 0


def run_workload(cfg: SchedulerConfig, requests: list[tuple[str, list[int], SamplingParams, int]]):
    sched = Scheduler(cfg, eos_token_ids=frozenset({EOS}))
    sim = KVSimulator(cfg.block_size, cfg.num_gpu_blocks, cfg.num_cpu_blocks)
    pending = list(requests)
    finished, steps, peak_running = {}, 0, 0
    while pending or sched.has_work:
        for _ in range(random.randint(0, 6)):  # arrivals trickle in between steps
            if pending:
                rid, prompt, params, prio = pending.pop(0)
                sched.add(rid, prompt, params, priority=prio)
        plan = sched.schedule()
        for out in sched.update(plan, sim.execute(plan)):
            if out.finished:
                finished[out.request_id] = out
        sched.blocks.check_invariants()
        peak_running = max(peak_running, len(sched.running))
        steps += 1
        assert steps < 20_000, "the scheduler stopped making progress"
    assert sched.blocks.num_free_blocks == cfg.num_gpu_blocks
    assert sched.blocks.cpu.num_free == cfg.num_cpu_blocks
    assert sched.blocks.usage().used == 0
    return sched, finished


def random_requests(rng: random.Random, count: int, shared_prefix: list[int]):
    out = []
    for i in range(count):
        prompt = (shared_prefix if rng.random() < 0.4 else []) + [rng.randint(1, 96) for _ in range(rng.randint(1, 60))]
        params = SamplingParams(
            n=rng.choice([1, 1, 1, 2, 3]), max_tokens=(m := rng.randint(1, 40)), min_tokens=rng.choice([0, 0, min(3, m)]),
        )
        out.append((f"req-{i}", prompt, params, rng.randint(0, 2)))
    return out


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("block_size", [4, 7])
def test_200_requests_through_a_tiny_pool(mode, block_size):
    rng = random.Random(f"{mode}-{block_size}")
    requests = random_requests(rng, 200, shared_prefix=[rng.randint(1, 96) for _ in range(20)])
    cfg = SchedulerConfig(
        num_gpu_blocks=80, block_size=block_size, num_cpu_blocks=40, max_num_seqs=24,
        max_num_batched_tokens=64, max_model_len=256, preemption_mode=mode,
    )
    sched, finished = run_workload(cfg, requests)
    assert sched.stats.num_preemptions > 0, "the pool was meant to be too small"
    assert sched.stats.prefix_hit_tokens > 0
    assert len(finished) == 200
    for rid, prompt, params, _ in requests:
        out = finished[rid]
        assert len(out.outputs) == params.n
        for o in out.outputs:
            expected = reference_output(prompt, o.index, params.max_tokens, EOS, params.min_tokens)
            assert o.token_ids == expected, rid
            assert o.finish_reason == (FinishReason.STOP if expected[-1] == EOS else FinishReason.LENGTH).value


class SchedulerMachine(RuleBasedStateMachine):
    """Random adds, aborts, stop-string finishes and steps, checking invariants after each."""

    @initialize(mode=st.sampled_from(["recompute", "swap"]), blocks=st.integers(12, 40), bs=st.sampled_from([1, 2, 3, 4]))
    def setup(self, mode, blocks, bs):
        self.cfg = SchedulerConfig(
            num_gpu_blocks=blocks, block_size=bs, num_cpu_blocks=16, max_num_seqs=6,
            max_num_batched_tokens=16, max_model_len=64, preemption_mode=mode,
        )
        self.sched = Scheduler(self.cfg, eos_token_ids=frozenset({EOS}))
        self.sim = KVSimulator(bs, blocks, 16)
        self.count = 0

    @rule(prompt=st.lists(st.integers(1, 4), min_size=1, max_size=10), n=st.integers(1, 3),
          max_tokens=st.integers(1, 5), prio=st.integers(0, 2))
    def add(self, prompt, n, max_tokens, prio):
        params = SamplingParams(n=n, max_tokens=max_tokens)
        if n * self.sched.blocks.blocks_for(len(prompt) + max_tokens) <= self.cfg.num_gpu_blocks:
            self.sched.add(f"r{self.count}", prompt, params, priority=prio)
            self.count += 1

    @rule(data=st.data())
    def abort(self, data):
        if self.sched.requests:
            self.sched.abort(data.draw(st.sampled_from(sorted(self.sched.requests))))

    @rule(data=st.data())
    def finish_one_seq(self, data):
        live = [s for r in self.sched.running for s in r.live_seqs]
        if live:
            self.sched.finish_seq(data.draw(st.sampled_from(live)).seq_id, FinishReason.STOP)

    @rule()
    def step(self):
        plan = self.sched.schedule()
        self.sched.update(plan, self.sim.execute(plan))

    @invariant()
    def consistent(self):
        if hasattr(self, "sched"):
            self.sched.blocks.check_invariants()

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(2000):
            if not self.sched.has_work:
                break
            self.step()
        assert not self.sched.has_work
        assert self.sched.blocks.num_free_blocks == self.cfg.num_gpu_blocks
        assert self.sched.blocks.cpu.num_free == self.cfg.num_cpu_blocks


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestSchedulerMachine = SchedulerMachine.TestCase
