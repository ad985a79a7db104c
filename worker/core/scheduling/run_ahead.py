"""Scheduling one step ahead (``--async-scheduling``): the host plans step N+1 while the device runs
step N, and reads step N's tokens while the device runs step N+1.

Once step N is launched, ``Scheduler.run_ahead(plan)`` moves its rows on as if their tokens were
in: computed counts advance, full blocks are published, sliding windows released (all of which
depend on positions, not on token values), and each sampled token is a ``PLACEHOLDER`` at the
end of its sequence. Step N+1 is scheduled from that state: a decoding row's token is the
placeholder, which the runner fills on the device from step N's sampled tokens (never read on
the host). ``Scheduler.update(plan, result, ahead=True)`` then takes the placeholders out and
appends the real tokens as a plain step would (stops, logprobs, detokenized outputs). A sequence
that step N ended (a stop token, a stop string, an abort) wastes its row in step N+1, whose
result skips it; one whose placeholder is its last token (``max_tokens``) gets no row.

Penalties read the token history, whose last token may be a placeholder: the runner hands the
sampler that token from the previous step's, on the device (``LaunchedStep.history_tails``). A step
runs ahead only when no row's next step needs its token on the host first: grammars, beam search,
forks (``n > 1``), drafts, prompt logprobs and embeddings run one step at a time, as before. The
step loop decides (``worker/step_loop.py``); the tokens are exactly those of the step-at-a-time path.
"""

from __future__ import annotations

from pagedserve.worker.core.scheduling.plan import ScheduledSeq, StepPlan

PLACEHOLDER = -1  # a token id no vocabulary has: the previous step's sampled token, filled in on the device


def can_run_ahead(plan: StepPlan) -> bool:
    """Whether the next step may be planned before ``plan``'s tokens reach the host."""
    return all(map(_row_runs_ahead, plan.seqs))


def _row_runs_ahead(row: ScheduledSeq) -> bool:
    plain = row.num_samples <= 1 and not row.params.use_beam_search and row.grammar is None
    host_reads = row.prompt_targets or row.pool_from is not None
    return plain and not host_reads and not row.num_draft and row.draft_context is None
