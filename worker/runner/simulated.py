"""A stand-in for the model runner, for measuring the service at scale on machines without the
GPUs: each step takes the time the real model would (a sleep from a calibrated cost model) and
every sampling row gets a token made from its sequence, so the scheduler, block manager, prefix
cache, KV events and Redis I/O all run for real while the forward pass costs no CPU.

``SimulatedCost`` (``worker/runner/simulated_cost.py``): ``base + per_seq * sequences + per_token * tokens``
seconds per step, fitted to the real model by ``bench/scale.py --calibrate``. Beam search is not simulated (its requests fail).
"""

from __future__ import annotations

import time

from pagedserve.worker.core.scheduling.plan import SampledToken, StepPlan, StepResult
from pagedserve.worker.runner.simulated_cost import SimulatedCost

FIRST_TOKEN = 10  # simulated tokens stay clear of the special ids at the start of the vocabulary


class SimulatedRunner:
    def __init__(self, cost: SimulatedCost, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.cost = cost
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def execute(self, plan: StepPlan) -> StepResult:
        if any(s.params.use_beam_search for s in plan.seqs):
            raise ValueError("beam search is not simulated")
        if plan.seqs:
            time.sleep(self.cost.seconds(len(plan.seqs), plan.num_tokens))
        return StepResult({s.seq_id: tuple(SampledToken(self._token(s.token_ids[-1], s.context_len + i))
                                           for i in range(s.num_samples))
                           for s in plan.seqs if s.num_samples})

    def _token(self, last: int, position: int) -> int:
        token = FIRST_TOKEN + (last * 31 + position * 7) % (self.vocab_size - FIRST_TOKEN)
        return token if token not in self.eos_token_ids else FIRST_TOKEN
