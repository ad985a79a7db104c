"""Speculative decoding: draft a row's next tokens, by prompt lookup (n-gram) from its own history or
with a small draft model, let one forward check them all, keep the ones the model would have produced.

``--speculative-config`` takes vLLM's JSON: ``{"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_max": n, "prompt_lookup_min": m}`` or ``{"model": DRAFT, "num_speculative_tokens": k}``
(``"method": "draft_model"`` implied; ``"quantization"`` for the draft's weights). Prompt lookup looks for the longest suffix of the
sequence (``n`` tokens down to ``m``) that occurred earlier in it and proposes the ``k`` tokens that
followed its latest earlier occurrence: text that copies from its prompt (code edits, quotes,
summaries that cite) gets long runs accepted; text that does not gets no proposal and costs nothing.

Rows of one sequence draft (greedy or sampled, with or without a grammar; not forks, not beam
search). The runner checks a draft with the row's own sampler at each position
(``worker/runner/speculative/draft_check.py``: rejection sampling for a one-token draft), so every token comes
from the distribution a step of its own would use, and a greedy or seeded row gets exactly the
tokens it gets without speculation. Each sequence paces its drafts (``DraftPace``): a row whose
drafts are rejected drafts less often, so text that does not repeat costs almost nothing; and a
draft is only as long as its tokens pay for themselves at what a checked token costs in a step of
this size (``StepCost``, ``worker/core/speculative/draft_cost.py``: fitted to the engine's own steps of that size). A draft model
(``worker/runner/speculative/draft_model.py``) drafts greedily with its own KV pool on the target's block ids.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Sequence

MAX_SPECULATIVE_TOKENS = 16
METHODS = ("ngram", "draft_model")
MAX_DRAFT_WAIT = 31  # steps a row whose drafts keep failing waits, at most, before it drafts again
RATE_DECAY = 0.9  # a row's kept rate: each older check weighs this much as the next


@dataclass
class KeptRate:
    """The chance a drafted token is kept given the one before it was: kept tokens over checked
    ones (the tokens up to the first rejected one), each older check weighing ``RATE_DECAY`` as
    much as the next; 1/2 before the first check, unless it starts from what similar rows kept."""
    kept: float = 1.0
    checked: float = 2.0

    @property
    def value(self) -> float:
        return self.kept / self.checked

    def update(self, drafted: int, accepted: int) -> None:
        # The tokens up to the first rejected one were checked; the ones after it tell nothing.
        self.kept = RATE_DECAY * self.kept + accepted
        self.checked = RATE_DECAY * self.checked + accepted + (accepted < drafted)

    def start(self) -> "KeptRate":
        """A new row's rate: this one's value, weighing as much as the default's 1/2 does."""
        return KeptRate(2.0 * self.value, 2.0)


@dataclass
class DraftPace:
    """One sequence's drafting: how long its next draft may be, how many of its steps to skip
    before it, and how often its drafted tokens are kept (``KeptRate``). A draft with anything kept
    lets the next be ``limit`` long (how much of it pays is ``worth``'s to say, from the kept rate
    and the step's cost); one with nothing kept makes the next a single token, after 1, 3, 7, ...
    steps without drafting (at most ``MAX_DRAFT_WAIT``)."""
    limit: int
    length: int = 0
    wait: int = 0
    misses: int = 0
    rate: KeptRate = field(default_factory=KeptRate)

    def __post_init__(self) -> None:
        self.length = self.length or self.limit

    @property
    def kept_rate(self) -> float:
        return self.rate.value

    def ready(self) -> bool:
        """Whether this step may draft (a step that may not counts down the wait)."""
        if self.wait:
            self.wait -= 1
            return False
        return True

    def checked(self, drafted: int, accepted: int) -> None:
        self.rate.update(drafted, accepted)
        if accepted == 0:
            self.misses += 1
            self.length, self.wait = 1, min(2 ** self.misses - 1, MAX_DRAFT_WAIT)
            return
        self.misses = 0
        self.length = self.limit

    def worth(self, token_share: float) -> int:
        """How many drafted tokens pay for themselves when checking one costs ``token_share`` of
        a step's time per row: the j-th is kept with chance ``kept_rate ** j`` and, kept, saves a
        row's share of a step (1); it costs ``token_share`` either way."""
        rate = self.kept_rate
        if token_share <= 0 or rate >= 1:
            return self.length
        if token_share >= 1 or rate <= 0:
            return 0
        return min(self.length, int(math.log(token_share) / math.log(rate)))


def prices_drafts(row) -> bool:
    """Whether a step's row (a ``ScheduledSeq``) lets its step price drafted tokens (``StepCost``,
    ``worker/core/speculative/draft_cost.py``): a decode, with or without a draft, whose draft model catches up
    on no more than the steps a pace may skip. A prefill chunk's tokens, or a draft's first pass over a whole prompt, cost what
    they cost once, not what a drafted token costs."""
    return row.num_tokens == 1 + row.num_draft and len(row.draft_context or ()) <= MAX_DRAFT_WAIT + 1


@dataclass
class SpecStats:
    """vLLM's ``spec_decode`` counters: rows that carried a draft, drafted tokens, accepted ones,
    and accepted ones by position in the draft; and the kept rate of recent greedy and sampled
    rows, which a new row of that kind starts from (``lately[greedy]``): rows whose drafts are
    rarely kept (text sampled at a high temperature) stop paying for first drafts."""
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_by_position: list[int] = field(default_factory=lambda: [0] * MAX_SPECULATIVE_TOKENS)
    lately: dict[bool, KeptRate] = field(default_factory=lambda: {True: KeptRate(), False: KeptRate()})

    def record(self, num_draft: int, accepted: int, greedy: bool = True) -> None:
        self.lately[greedy].update(num_draft, accepted)
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
    model: str | None = None  # method "draft_model": the draft's path (a model directory or a .gguf)
    quantization: str = "auto"  # the draft's linear layers' weights, as --quantization

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported (only {', '.join(map(repr, METHODS))})")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError('a speculative draft model needs "model" (a path), and "model" needs method "draft_model"')
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative model must be a path, got {self.model!r}")
        if not isinstance(self.quantization, str):  # which names: EngineConfig (the kernels' list)
            raise ValueError(f"speculative quantization must be a name, got {self.quantization!r}")
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
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model", "quantization"}
        if unknown := sorted(set(value) - known):
            raise ValueError(f"unknown --speculative-config keys: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        if "model" in value:
            value = {"method": "draft_model", **value}
        if "method" not in value:
            raise ValueError('--speculative-config needs "method" ("ngram") or "model" (a draft model)')
        return cls(**value)

    def propose(self, tokens: Sequence[int], limit: int) -> tuple[int, ...]:
        """``min(limit, k)`` tokens that followed the latest earlier occurrence of the longest suffix
        of ``tokens`` (``prompt_lookup_max`` down to ``prompt_lookup_min`` long); () if none. Where
        they run into the sequence's end, the text is taken to go on repeating with the period
        between the occurrence and the suffix (a loop keeps looping). One pass back over the
        sequence, comparing only where its last token recurs."""
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
        start = best_end + 1
        period = length - start  # the suffix recurs this far back: past the end, the text repeats with this period
        draft: list[int] = []
        for i in range(limit):
            draft.append(tokens[start + i] if start + i < length else draft[i - period])
        return tuple(draft)

