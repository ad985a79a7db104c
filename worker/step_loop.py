"""Steps launched and their results applied: one at a time, or one ahead (``--async-scheduling``,
``worker/core/scheduling/run_ahead.py``): the step launched by one call stays on the device while
the next call plans and launches the one after it, then applies its tokens.

A failed launch or read fails the requests the step holds (and those whose KV it may have moved),
not the engine; a broken device or a lost tensor-parallel rank raises ``DeviceFailure``. Each
finished step's time feeds ``last_forward`` and the fits that size prefill chunks (``--max-step-ms``)
and drafts.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass

import structlog
import torch

from pagedserve.worker.core.scheduling.outputs import RequestOutput
from pagedserve.worker.core.scheduling.plan import StepPlan, StepResult
from pagedserve.worker.core.scheduling.run_ahead import can_run_ahead
from pagedserve.worker.core.scheduling.scheduler import Scheduler
from pagedserve.worker.core.scheduling.step_time import pairs
from pagedserve.worker.core.speculative.config import prices_drafts
from pagedserve.worker.in_flight import InFlight
from pagedserve.worker.runner.device.failures import DeviceFailure, device_guard, is_device_failure
from pagedserve.worker.runner.parallel.group import RankFailure
from pagedserve.worker.runner.simulated import SimulatedRunner
from pagedserve.worker.setup.ranks import Ranks

log = structlog.get_logger("pagedserve.engine")


@dataclass(frozen=True)
class StepTiming:
    """The last step's forward: how many sequences and tokens, and how long the runner took."""
    seqs: int
    tokens: int
    seconds: float


class StepLoop:
    def __init__(self, scheduler: Scheduler, runner, device: torch.device, ranks: Ranks | None, runs_ahead: bool) -> None:
        """``runner``: a ModelRunner (``launch``) or the SimulatedRunner (``execute``)."""
        self.scheduler, self.runner, self.device, self.ranks, self.runs_ahead = scheduler, runner, device, ranks, runs_ahead
        self.in_flight: InFlight | None = None  # a step launched ahead, its tokens not yet applied
        self.last_forward: StepTiming | None = None

    def step(self) -> list[RequestOutput]:
        """One step: plan, launch, and the outputs of the step whose tokens came in. Running ahead,
        the step launched here stays on the device while the next call plans the one after, and this
        call's outputs are the previous launch's."""
        step_started = time.perf_counter()
        plan = self.scheduler.schedule()
        previous, self.in_flight = self.in_flight, None
        if previous is None and plan.is_empty and (compiling := self.scheduler.compiling()):
            wait(compiling, timeout=0.05, return_when=FIRST_COMPLETED)  # nothing to run until a grammar is built
        elif previous is None and plan.is_empty and self.scheduler.waits_on_disk:
            time.sleep(0.001)  # nothing to run until a prefix is read from disk
        launched = self._launch(plan, previous)
        outputs = self._finish(previous) if previous is not None else []
        if launched.ahead:
            self.scheduler.run_ahead(plan)
            self.in_flight = launched
        else:
            outputs += self._finish(launched)
        if plan.seqs or previous is not None:  # a stream waits this long for its next token (scheduling, the forward, the outputs)
            self.scheduler.stats.step_seconds.observe(time.perf_counter() - step_started)
        return outputs

    def _launch(self, plan: StepPlan, previous: InFlight | None) -> InFlight:
        """``plan`` queued on the device (its placeholder tokens from ``previous``'s); when that fails,
        its requests fail with it (an empty result: they are ended)."""
        ahead, started = self.runs_ahead and bool(plan.seqs) and can_run_ahead(plan), time.perf_counter()
        try:
            with device_guard(self.device):
                if isinstance(self.runner, SimulatedRunner):
                    return InFlight(plan, started, ready=self.runner.execute(plan))
                return InFlight(plan, started, self.runner.launch(plan, previous and previous.launched), ahead)
        except Exception as err:
            self._step_failed(err, plan)
            return InFlight(plan, started, ready=StepResult())

    def _finish(self, step: InFlight) -> list[RequestOutput]:
        """The step's result applied (its timing fed to the step-time fits): its requests' outputs."""
        try:
            with device_guard(self.device):
                result = step.result()
            self._observe(step.plan, result, step.seconds())
        except Exception as err:
            self._step_failed(err, step.plan)
            result = StepResult()
        return self.scheduler.update(step.plan, result, ahead=step.ahead)

    def _observe(self, plan: StepPlan, result: StepResult, seconds: float) -> None:
        """A finished step's time, for ``last_forward`` and the fits that size steps and drafts."""
        self.last_forward = StepTiming(len(plan.seqs), plan.num_tokens, seconds)
        if self.scheduler.step_time is not None and plan.seqs and not any(s.num_draft for s in plan.seqs):
            attended = sum(pairs(s.start, s.num_tokens) for s in plan.seqs)
            self.scheduler.step_time.observe(plan.num_tokens, attended, seconds)
        if self.scheduler.step_cost is not None and plan.seqs and all(map(prices_drafts, plan.seqs)):
            drafted = any(s.num_draft for s in plan.seqs)
            self.scheduler.step_cost.observe(len(plan.seqs), plan.num_tokens, seconds, drafted,
                                             result.draft_rounds, result.draft_seconds)

    def _step_failed(self, err: Exception, plan: StepPlan) -> None:
        """A bad kernel launch, out of memory, a bug: fail the requests the step holds, not the engine;
        a broken device or a lost rank raises ``DeviceFailure`` (nothing is failed: the worker ends)."""
        if isinstance(err, RankFailure) and self.ranks is not None:  # say which rank went, not gloo's words
            raise DeviceFailure(self.ranks.explain(err)) from err
        if is_device_failure(err):
            log.error("device failed: stopping for a restart", requests=len(plan.seqs), error=str(err))
            raise DeviceFailure(f"the device failed: {type(err).__name__}: {err}") from err
        log.exception("engine step failed", requests=len(plan.seqs))
        self._fail_holders(plan, f"the engine step failed: {type(err).__name__}: {err}")

    def _fail_holders(self, plan, message: str) -> None:
        """End with an error every request the failed step touched or whose KV it may have moved
        (running and swapped ones); waiting requests hold no KV and go on."""
        sched = self.scheduler
        doomed = {s.request_id for s in plan.seqs} | {r.request_id for r in (*sched.running, *sched.swapped)}
        for request_id in doomed:
            sched.abort(request_id, error=message)
