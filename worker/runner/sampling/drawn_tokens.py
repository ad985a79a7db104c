"""A step's drawn tokens on their way to the host, and the ``SampledToken`` entries they become.

``Sampler.draw`` leaves every number a row reports on the device (the token, its logprob, its rank,
the top logprobs asked for) and queues one copy of them to the host (``HostCopy``); ``read`` waits
for that copy alone, so a step planned ahead runs on the device while the host reads the one before
(``worker/core/scheduling/run_ahead.py``). ``tokens`` stays on the device for the next step's
placeholders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pagedserve.worker.core.scheduling.plan import SampledToken
from pagedserve.worker.runner.transfers.host_copies import HostCopy


@dataclass(frozen=True)
class DrawnTokens:
    num_samples: tuple[int, ...]  # each row's tokens (its ``num_samples``), in order
    wants: tuple[bool, ...]  # each drawn token's row asked for logprobs (the alternatives and rank)
    top_k: dict[int, int]  # drawn token -> how many top logprobs its row asked for
    tokens: torch.Tensor  # int64 [drawn tokens], on the device
    copy: HostCopy  # tokens, their logprobs, and (when asked) ranks and the top logprobs' values and ids

    @classmethod
    def queue(cls, num_samples: Sequence[int], wants: Sequence[bool], top_k: dict[int, int], tokens: torch.Tensor,
              picked: torch.Tensor, ranks: torch.Tensor | None, top: tuple[torch.Tensor, torch.Tensor] | None) -> DrawnTokens:
        extra = ((ranks,) if ranks is not None else ()) + (top if top is not None else ())
        return cls(tuple(num_samples), tuple(wants), top_k, tokens, HostCopy.queue(tokens, picked, *extra))

    def read(self) -> list[list[SampledToken]]:
        """Each row's ``num_samples`` tokens (waits for this step's copy to the host)."""
        tokens, picked, *extra = (t.tolist() for t in self.copy.read())
        ranks = extra.pop(0) if any(self.wants) else None
        top_values, top_ids = extra if extra else ([], [])
        rows_of_top = {flat: j for j, flat in enumerate(sorted(self.top_k))}
        out, i = [], 0
        for count in self.num_samples:
            row = []
            for flat in range(i, i + count):
                top = None
                if flat in rows_of_top:
                    j, k = rows_of_top[flat], self.top_k[flat]
                    top = (top_ids[j][:k], top_values[j][:k])
                row.append(scored_token(tokens[flat], picked[flat], top, self.wants[flat], ranks[flat] if ranks else None))
            out.append(row)
            i += count
        return out


def scored_token(token: int, logprob: float, top: tuple[list[int], list[float]] | None, alternatives: bool,
                 rank: int | None = None) -> SampledToken:
    """``token`` with its logprob and, when ``alternatives``, the top ``(ids, logprobs)`` with the
    token itself always among them, and its rank in the vocabulary (sampled tokens, and prompt
    tokens for ``prompt_logprobs``)."""
    found = None
    if alternatives:
        found = dict(zip(*top)) if top else {}
        if token in found:  # among the top: its place there is its rank (as vLLM's entry says), whatever ties
            rank = top[0].index(token) + 1
        found[token] = logprob
    return SampledToken(token, logprob, found, rank if alternatives else None)
