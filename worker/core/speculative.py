"""Speculative decoding by prompt lookup (n-gram): guess a row's next tokens from its own history,
let one forward check them all, keep the ones the model would have produced.

``--speculative-config`` takes vLLM's JSON: ``{"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_max": n, "prompt_lookup_min": m}``. The proposer looks for the longest suffix of the
sequence (``n`` tokens down to ``m``) that occurred earlier in it and proposes the ``k`` tokens that
followed its latest earlier occurrence: text that copies from its prompt (code edits, quotes,
summaries that cite) gets long runs accepted; text that does not gets no proposal and costs nothing.

Greedy rows only, for now: a row is verified by taking the model's own greedy choice at each
position (the same sampler, with the accepted tokens as history), so the output is token for token
what the engine gives without speculation. Draft models and rejection sampling for sampled rows are
not built: a ``"model"`` config is refused with that reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Sequence

MAX_SPECULATIVE_TOKENS = 16


@dataclass
class SpecStats:
    """vLLM's ``spec_decode`` counters: rows that carried a draft, guessed tokens, accepted ones,
    and accepted ones by position in the draft."""
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_by_position: list[int] = field(default_factory=lambda: [0] * MAX_SPECULATIVE_TOKENS)

    def record(self, num_draft: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += num_draft
        self.accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_by_position[position] += 1


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    method: str = "ngram"

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative method {self.method!r} is not supported (only 'ngram', prompt lookup)")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative {name} must be a positive integer, got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: str | dict | None) -> "SpeculativeConfig | None":
        """vLLM's ``--speculative-config`` (a JSON object, or the dict it decodes to); None: off."""
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"--speculative-config is not JSON: {err}") from None
        if not isinstance(value, dict):
            raise ValueError("--speculative-config must be a JSON object")
        if "model" in value:
            raise ValueError("speculative decoding with a draft model is not supported yet; "
                             'use {"method": "ngram", "num_speculative_tokens": k}')
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        if unknown := sorted(set(value) - known):
            raise ValueError(f"unknown --speculative-config keys: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        if "method" not in value:
            raise ValueError('--speculative-config needs "method" ("ngram")')
        return cls(**value)

    def propose(self, tokens: Sequence[int], limit: int) -> tuple[int, ...]:
        """Up to ``min(limit, k)`` tokens that followed the latest earlier occurrence of the longest
        suffix of ``tokens`` (``prompt_lookup_max`` down to ``prompt_lookup_min`` long); () if none.
        One pass back over the sequence, comparing only where its last token recurs."""
        limit, length = min(limit, self.num_speculative_tokens), len(tokens)
        if limit <= 0 or length < 2:
            return ()
        last, longest = tokens[-1], self.prompt_lookup_max
        best, best_end = 0, -1
        for end in range(length - 2, -1, -1):
            if tokens[end] != last:
                continue
            matched = 1
            while matched < longest and end - matched >= 0 and tokens[end - matched] == tokens[length - 1 - matched]:
                matched += 1
            if matched > best:
                best, best_end = matched, end
                if matched == longest:
                    break
        if best < self.prompt_lookup_min:
            return ()
        return tuple(tokens[best_end + 1 : best_end + 1 + limit])
