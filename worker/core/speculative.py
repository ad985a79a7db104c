"""Speculative decoding by prompt lookup (n-gram): guess a row's next tokens from its own history,
let one forward check them all, keep the ones the model would have produced.

``--speculative-config`` takes vLLM's JSON: ``{"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_max": n, "prompt_lookup_min": m}``. The proposer looks for the longest suffix of the
sequence (``n`` tokens down to ``m``) that occurred earlier in it and proposes the ``k`` tokens that
followed its latest earlier occurrence: text that copies from its prompt (code edits, quotes,
summaries that cite) gets long runs accepted; text that does not gets no proposal and costs nothing.

Rows of one sequence guess (greedy or sampled, with or without a grammar; not forks, not beam
search). The runner checks a guess with the row's own sampler at each position
(``worker/runner/draft_check.py``: rejection sampling for a one-token guess), so every token comes
from the distribution a step of its own would use, and a greedy or seeded row gets exactly the
tokens it gets without speculation. Each sequence paces its guesses (``DraftPace``): a row whose
guesses are rejected guesses less often, so text that does not repeat costs almost nothing; and a
guess is only as long as its tokens pay for themselves at what a checked token costs in a step of
this size (``StepCost``, fitted to the engine's own step times). Draft models are not built: a ``"model"`` config is refused with that reason.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Sequence

MAX_SPECULATIVE_TOKENS = 16
MAX_DRAFT_WAIT = 31  # steps a row whose guesses keep failing waits, at most, before it guesses again
RATE_DECAY = 0.9  # a row's kept rate: each older check weighs this much as the next
COST_DECAY = 0.98  # the step cost fit: each older step weighs this much as the next
MIN_COST_STEPS = 8  # steps seen before the fit is used


@dataclass
class DraftPace:
    """One sequence's guessing: how long its next guess may be, how many of its steps to skip
    before it, and how often its guessed tokens are kept. A guess kept whole doubles the next (up to
    ``limit``); one kept in part makes the next one token longer than what was kept; one with
    nothing kept makes the next a single token, after 1, 3, 7, ... steps without guessing (at most
    ``MAX_DRAFT_WAIT``). ``kept_rate`` is the chance a guessed token is kept given the one before it
    was (kept tokens over checked ones, older checks weighing less; 1/2 before the first check)."""
    limit: int
    length: int = 0
    wait: int = 0
    misses: int = 0
    kept: float = 1.0
    checked_tokens: float = 2.0

    def __post_init__(self) -> None:
        self.length = self.length or self.limit

    @property
    def kept_rate(self) -> float:
        return self.kept / self.checked_tokens

    def ready(self) -> bool:
        """Whether this step may guess (a step that may not counts down the wait)."""
        if self.wait:
            self.wait -= 1
            return False
        return True

    def checked(self, drafted: int, accepted: int) -> None:
        # The tokens up to the first rejected one were checked; the ones after it tell nothing.
        self.kept = RATE_DECAY * self.kept + accepted
        self.checked_tokens = RATE_DECAY * self.checked_tokens + accepted + (accepted < drafted)
        if accepted == 0:
            self.misses += 1
            self.length, self.wait = 1, min(2 ** self.misses - 1, MAX_DRAFT_WAIT)
            return
        self.misses = 0
        self.length = min(self.limit, 2 * self.length if accepted == drafted else accepted + 1)

    def worth(self, token_share: float) -> int:
        """How many guessed tokens pay for themselves when checking one costs ``token_share`` of
        a step's time per row: the j-th is kept with chance ``kept_rate ** j`` and, kept, saves a
        row's share of a step (1); it costs ``token_share`` either way."""
        rate = self.kept_rate
        if token_share <= 0 or rate >= 1:
            return self.length
        if token_share >= 1 or rate <= 0:
            return 0
        return min(self.length, int(math.log(token_share) / math.log(rate)))


@dataclass
class StepCost:
    """A step's time as a fixed part and a part per token, fitted over the recent steps (least
    squares, each older step weighing ``COST_DECAY`` as much as the next). ``token_share(rows)``: the
    part of a step of ``rows`` one-token rows that is its tokens' own cost, per row the price of
    checking one guessed token against what a kept one saves. 0 (guess freely) until steps of
    different sizes have been seen; near 1 where the forward's cost grows with every token (a
    batch big enough that the device computes, rather than reads, most of the step)."""
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # weight, x, y, xx, xy

    def observe(self, tokens: int, seconds: float) -> None:
        w, x, y, xx, xy = (v * COST_DECAY for v in self.sums)
        self.sums = [w + 1, x + tokens, y + seconds, xx + tokens * tokens, xy + tokens * seconds]

    def token_share(self, rows: int) -> float:
        w, x, y, xx, xy = self.sums
        spread = w * xx - x * x
        if w < MIN_COST_STEPS or spread <= 1e-9 * w * xx:
            return 0.0
        per_token = (w * xy - x * y) / spread
        fixed = (y - per_token * x) / w
        if per_token <= 0:
            return 0.0
        return min(1.0, per_token * rows / max(fixed + per_token * rows, 1e-12))


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

