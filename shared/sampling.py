"""SamplingParams: how to pick tokens and when to stop, validated once at construction.

Frozen and pure (no torch): the gateway validates client input with it, the engine reads it.
Every out-of-range value raises ``InvalidRequestError`` naming the field. ``BOUNDS`` is the one
statement of each numeric parameter's range: validation here and the gateway's OpenAPI schema
both read it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.structured import StructuredOutputs

MAX_LOGPROBS = 20
MAX_SEQS = 64  # beam_width and best_of
MAX_TOKEN_ID = 2**31
OPTIONAL = frozenset({"seed", "logprobs", "prompt_logprobs", "best_of"})  # None means "not set"
POOLING = ("last", "mean")


@dataclass(frozen=True)
class Bound:
    """The range of one numeric parameter: ``[low, high]``, or ``(low, high]`` when ``low_open``."""

    kind: type  # int or float
    low: float
    high: float | None = None
    low_open: bool = False

    def json_schema(self) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "integer" if self.kind is int else "number"}
        schema["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        if self.high is not None:
            schema["maximum"] = self.high
        return schema


BOUNDS: dict[str, Bound] = {
    "n": Bound(int, 1),
    "max_tokens": Bound(int, 1),
    "min_tokens": Bound(int, 0),
    "temperature": Bound(float, 0.0, 100.0),
    "top_k": Bound(int, -1, MAX_TOKEN_ID),  # -1 (or 0): all tokens
    "top_p": Bound(float, 0.0, 1.0, low_open=True),
    "min_p": Bound(float, 0.0, 1.0),
    "presence_penalty": Bound(float, -2.0, 2.0),
    "frequency_penalty": Bound(float, -2.0, 2.0),
    "repetition_penalty": Bound(float, 0.0, 100.0, low_open=True),
    "seed": Bound(int, -(2**63), 2**63 - 1),
    "logprobs": Bound(int, 0, MAX_LOGPROBS),
    "prompt_logprobs": Bound(int, 0, MAX_LOGPROBS),
    "best_of": Bound(int, 1, MAX_SEQS),  # and >= n
    "beam_width": Bound(int, 1, MAX_SEQS),
    "length_penalty": Bound(float, -10.0, 10.0),
}
NOT_REQUEST_FIELDS = frozenset({"prompt_logprobs"})  # bounded here, but set over HTTP by echo + logprobs


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 (or -1): all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: int | None = None  # top-N alternatives per sampled token (the sampled one is always included)
    # for every prompt position after the first: the logprob of the prompt's own token there and the
    # top-N alternatives (vLLM's field; such a prompt is computed in full, never taken from the prefix cache)
    prompt_logprobs: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    best_of: int | None = None  # sample this many, return the n with the highest cumulative logprob
    use_beam_search: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as in transformers
    structured: StructuredOutputs | None = None  # output constrained to a schema, regex, choice or grammar
    # an embedding, not a generation: the prompt's final hidden states pooled ("last" token or "mean"),
    # normalised; the request ends once its prompt is computed, with no token (vLLM's pooling runner)
    pooling: str | None = None

    def __post_init__(self) -> None:
        for name in ("stop", "stop_token_ids"):  # checked before they are made tuples below
            if not isinstance(getattr(self, name), (list, tuple, str, type(None))):
                raise InvalidRequestError(f"{name} must be a list", name)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.structured is not None and not isinstance(self.structured, StructuredOutputs):
            object.__setattr__(self, "structured", StructuredOutputs.from_dict(self.structured))  # a wire map
        self._validate()

    def _validate(self) -> None:
        for name, bound in BOUNDS.items():
            if getattr(self, name) is not None or name not in OPTIONAL:
                _check(name, getattr(self, name), bound)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})", "min_tokens"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop must be a list of non-empty strings", "stop")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < MAX_TOKEN_ID:
                raise InvalidRequestError(f"stop_token_ids must be integers in [0, {MAX_TOKEN_ID})", "stop_token_ids")
        for name in ("ignore_eos", "skip_special_tokens", "use_beam_search"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be a boolean", name)
        self._validate_search()
        if self.pooling is not None:
            if self.pooling not in POOLING:
                raise InvalidRequestError(f"pooling must be one of {', '.join(POOLING)}, got {self.pooling!r}", "pooling")
            if self.num_seqs != 1 or self.structured is not None:
                raise InvalidRequestError("an embedding (pooling) is one sequence, unconstrained", "pooling")

    def _validate_search(self) -> None:
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):  # 0 == False: not a bool
            raise InvalidRequestError('early_stopping must be true, false or "never"', "early_stopping")
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidRequestError(f"best_of must be in [{self.n}, {MAX_SEQS}] (>= n), got {self.best_of}", "best_of")
        if self.use_beam_search:
            if self.n > self.beam_width:
                raise InvalidRequestError(f"n ({self.n}) must be <= beam_width ({self.beam_width})", "n")
            if self.best_of is not None or self.stop:
                raise InvalidRequestError("beam search takes neither best_of nor stop strings", "use_beam_search")
            if self.structured is not None:
                raise InvalidRequestError("beam search cannot be combined with structured outputs", "use_beam_search")

    @property
    def num_seqs(self) -> int:
        """Sequences the engine runs for one request: beams, best_of samples, or n."""
        if self.use_beam_search:
            return self.beam_width
        return self.best_of or self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (lists, not tuples), for the wire."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["stop"], out["stop_token_ids"] = list(self.stop), list(self.stop_token_ids)
        out["structured"] = self.structured.to_dict() if self.structured is not None else None
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        """From a wire map; any malformed value is an ``InvalidRequestError`` naming its field."""
        if not all(isinstance(k, str) for k in data):
            raise InvalidRequestError("sampling parameter names must be strings", "params")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameter(s): {', '.join(unknown)}", unknown[0])
        return cls(**data)


def _check(name: str, value: Any, bound: Bound) -> None:
    if bound.kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidRequestError(f"{name} must be an integer, got {value!r}", name)
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", name)
    too_low = value <= bound.low if bound.low_open else value < bound.low
    if too_low or (bound.high is not None and value > bound.high):
        if bound.high is None:
            where = f"> {bound.low}" if bound.low_open else f">= {bound.low}"
        else:
            where = f"in {'(' if bound.low_open else '['}{bound.low}, {bound.high}]"
        raise InvalidRequestError(f"{name} must be {where}, got {value}", name)
