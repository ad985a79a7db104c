"""Speculative decoding's check: which of a row's guessed tokens the model keeps.

At each guessed position the row's own sampler draws a token, with the guesses before it as the
row's history (penalties, ``min_tokens``, the grammar, and a seeded row's draw for that output
index); the row keeps the guesses up to the first one the draw disagrees with, then the draw there
(or after the last guess). A guess from prompt lookup is one token, not a distribution, so this is
rejection sampling for it: the guess is kept with the target's probability of it, and a rejected
position's token is the target's distribution without the guess, renormalised. Every token is
therefore drawn from exactly the distribution a step of its own would use; a greedy or seeded row
gets the very tokens it gets without speculation, and the logprobs are the target's.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pagedserve.worker.core.plan import SampledToken, ScheduledSeq
from pagedserve.worker.runner.sampler import Sampler


def check_drafts(sampler: Sampler, item: ScheduledSeq, draft_logits: torch.Tensor,
                 last_logits: torch.Tensor) -> tuple[SampledToken, ...]:
    """``draft_logits`` ``[num_draft, vocab]`` (the logits before each guess) and ``last_logits``
    (after the last) -> the accepted guesses and the row's own next token."""
    draft = item.token_ids[-item.num_draft :]
    states = _grammar_states(item.grammar, draft)
    history = bool(item.output_ids or item.prompt_ids)  # filled only when penalties read them
    rows = [replace(item, num_samples=1, num_output=item.num_output + j, grammar=state,
                    output_ids=item.output_ids + draft[:j] if history else item.output_ids)
            for j, state in enumerate(states)]
    logits = torch.cat([draft_logits, last_logits[None]])[: len(rows)]
    picked = [tokens[0] for tokens in sampler.sample(logits, rows)]
    accepted = 0
    while accepted < len(picked) - 1 and picked[accepted].token_id == draft[accepted]:
        accepted += 1
    return tuple(picked[: accepted + 1])


def _grammar_states(grammar, draft: tuple[int, ...]) -> list:
    """The row's grammar state before each guessed position and after the last (None without a
    grammar), up to the first guess the grammar refuses: the positions after it are never kept."""
    if grammar is None:
        return [None] * (len(draft) + 1)
    states = [grammar]
    for token in draft:
        state = states[-1].deep_copy()
        if not state.consume_token(token):
            break
        states.append(state)
    return states
