"""Which rows draft this step, and what: the scheduler's half of speculative decoding.

A row drafts when it decodes one token of one sequence (no fork, no beam search; not under a sliding
window or long-rope's switch), its pace allows (``DraftPace``), and its drafted tokens pay for
themselves at this step's size (``StepCost``). Prompt lookup's draft is cut before the first token
the row's grammar refuses, and carries the grammar's state at each drafted position for the runner's
check (``worker/runner/speculative/draft_check.py``). A draft model's draft is its length alone: the
runner's drafter (``worker/runner/speculative/draft_model.py``) makes the tokens, after catching its
own KV up on the tokens before the row's (``draft_context``); rows with a grammar get no draft-model
draft.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.worker.core.scheduling.config import SchedulerConfig
from pagedserve.worker.core.scheduling.request import Request, Sequence
from pagedserve.worker.core.scheduling.structured_state import draft_states
from pagedserve.worker.core.speculative.config import MAX_DRAFT_WAIT, DraftPace, KeptRate


@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...]
    grammars: tuple = ()  # with a grammar: its state before each drafted token and after the last
    draft_context: tuple[int, ...] | None = None  # a draft model's draft (tokens all 0 until it makes them)


NO_DRAFT = Draft(())  # a row that decodes plainly


def row_draft(config: SchedulerConfig, req: Request, seq: Sequence, count: int, budget: int, token_share: float,
              lately: dict[bool, KeptRate] | None = None, blind: bool = False) -> Draft | None:
    """The draft for ``seq``'s step of ``count`` tokens, at most ``budget - 1`` tokens, within its
    ``max_tokens`` and the context; None where it makes none. A row's first draft starts from the
    kept rate of recent rows of its kind, greedy or sampled (``lately``, ``SpecStats``). ``blind``
    (several rows, and the step cost of that many not priced yet): one token at most, and no draft
    model's first pass over a prompt (a prefill's cost), which a batch must not pay for every row
    before anyone knows it pays."""
    spec, p = config.speculative, req.params
    if (spec is None or p.use_beam_search or p.num_seqs != 1 or count != 1 or seq.num_uncomputed != 1
            or config.sliding_window or config.rope_switch):
        return None
    room = min(p.max_tokens - seq.num_output - 1, config.max_model_len - seq.num_tokens, budget - 1)
    if seq.draft_pace is None:
        prior = (lately or {}).get(p.greedy)
        seq.draft_pace = DraftPace(spec.num_speculative_tokens, rate=prior.start() if prior else KeptRate())
    pace = seq.draft_pace
    if not pace.ready():
        return None
    length = min(room, pace.worth(token_share), 1 if blind else room)  # the pace's length is at most k
    if spec.model is not None:
        if seq.grammar is not None or length <= 0 or (blind and seq.num_computed - seq.draft_computed > MAX_DRAFT_WAIT + 1):
            return None
        return Draft((0,) * length, draft_context=tuple(seq.token_ids[seq.draft_computed : seq.num_computed]))
    tokens = spec.propose(seq.token_ids, length)
    states = draft_states(seq.grammar, tokens)
    if states:
        tokens = tokens[: len(states) - 1]
    return Draft(tokens, states) if tokens else None
