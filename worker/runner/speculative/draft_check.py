"""Speculative decoding's check: which of a row's drafted tokens the model keeps.

At each drafted position the row's own sampler draws a token, with the drafts before it as the
row's history (penalties, ``min_tokens``, the grammar state the scheduler advanced over them, and
a seeded row's draw for that output index); the row keeps the drafts up to the first one the draw
disagrees with, then the draw there (or after the last draft). A draft (from prompt lookup, or a
draft model's greedy pick) is one token, not a distribution, so this is rejection sampling for it:
the draft is kept with the target's probability of it, and a rejected position's token is the
target's distribution without the draft, renormalised. Every token is therefore drawn from exactly
the distribution a step of its own would use; a greedy or seeded row gets the very tokens it gets
without speculation, and the logprobs are the target's. All the step's drafting rows are checked
with one sampler call.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pagedserve.worker.core.scheduling.plan import SampledToken, ScheduledSeq
from pagedserve.worker.runner.sampling.sampler import Sampler


def check_drafts(sampler: Sampler, items: list[ScheduledSeq], draft_logits: list[torch.Tensor],
                 last_logits: torch.Tensor) -> list[tuple[SampledToken, ...]]:
    """For each drafting row: ``draft_logits`` ``[num_draft, vocab]`` (the logits before each
    draft) and its row of ``last_logits`` (after the last) -> the accepted drafts and the row's
    own next token."""
    rows, logits = [], []
    for item, before, last in zip(items, draft_logits, last_logits):
        rows.extend(_position_rows(item))
        logits.extend((before, last[None]))
    picked = [tokens[0] for tokens in sampler.sample(torch.cat(logits), rows)]
    out, at = [], 0
    for item in items:
        draft, drawn = item.token_ids[-item.num_draft :], picked[at : at + item.num_draft + 1]
        at += item.num_draft + 1
        accepted = 0
        while accepted < item.num_draft and drawn[accepted].token_id == draft[accepted]:
            accepted += 1
        out.append(tuple(drawn[: accepted + 1]))
    return out


def _position_rows(item: ScheduledSeq) -> list[ScheduledSeq]:
    """The row as it samples at each drafted position and after the last: one output further, the
    drafts before it in its history, its grammar advanced over them."""
    draft = item.token_ids[-item.num_draft :]
    states = item.draft_grammars or (None,) * (item.num_draft + 1)
    history = bool(item.output_ids or item.prompt_ids)  # filled only when penalties read them
    return [replace(item, num_samples=1, num_output=item.num_output + j, grammar=state,
                    output_ids=item.output_ids + draft[:j] if history else item.output_ids)
            for j, state in enumerate(states)]
