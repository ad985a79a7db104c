"""A step the engine has launched and not yet applied: its plan, whether it ran ahead
(``worker/core/scheduling/run_ahead.py``), and the runner's launch (or, from the simulated runner,
its result at once)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagedserve.worker.core.scheduling.plan import StepPlan, StepResult
from pagedserve.worker.runner.device.launched_step import LaunchedStep


@dataclass
class InFlight:
    plan: StepPlan
    started: float  # ``time.perf_counter()`` before its launch
    launched: LaunchedStep | None = None  # None: ``ready`` holds the result (the simulated runner, a failed launch)
    ahead: bool = False  # the next step was planned before this one's tokens came in
    ready: StepResult | None = None

    def result(self) -> StepResult:
        """The step's result (waits for its sampled tokens)."""
        return self.ready if self.launched is None else self.launched.result()

    def seconds(self) -> float:
        """What the step took: a step that ran ahead, the device's time (the host's launch on a CPU);
        else the wall clock from its launch to its result, as the step-time fits were always fed."""
        if self.ahead and self.launched is not None and self.launched.timer is not None:
            return self.launched.timer.seconds()
        return time.perf_counter() - self.started
