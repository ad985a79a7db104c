"""SamplingParams: how to pick tokens and when to stop, validated once at construction.

Frozen and pure (no torch): the gateway validates client input with it, the engine reads it.
Every out-of-range value raises ``InvalidRequestError`` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from shared.errors import InvalidRequestError

MAX_LOGPROBS = 20


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
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    best_of: int | None = None  # sample this many, return the n with the highest cumulative logprob
    use_beam_search: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as in transformers

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        _check_int(self, "n", low=1)
        _check_int(self, "max_tokens", low=1)
        _check_int(self, "min_tokens", low=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})", "min_tokens"
            )
        _check_float(self, "temperature", low=0.0, high=100.0)
        _check_int(self, "top_k", low=0)
        _check_float(self, "top_p", low=0.0, high=1.0, low_open=True)
        _check_float(self, "min_p", low=0.0, high=1.0)
        _check_float(self, "presence_penalty", low=-2.0, high=2.0)
        _check_float(self, "frequency_penalty", low=-2.0, high=2.0)
        _check_float(self, "repetition_penalty", low=0.0, high=100.0, low_open=True)
        if self.seed is not None:
            _check_int(self, "seed", low=-(2**63), high=2**63 - 1)
        if self.logprobs is not None:
            _check_int(self, "logprobs", low=0, high=MAX_LOGPROBS)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop must be a list of non-empty strings", "stop")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidRequestError("stop_token_ids must be non-negative integers", "stop_token_ids")
        for name in ("ignore_eos", "skip_special_tokens", "use_beam_search"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be a boolean", name)
        self._validate_search()

    def _validate_search(self) -> None:
        _check_int(self, "beam_width", low=1, high=64)
        _check_float(self, "length_penalty", low=-10.0, high=10.0)
        if self.early_stopping not in (True, False, "never"):
            raise InvalidRequestError('early_stopping must be true, false or "never"', "early_stopping")
        if self.best_of is not None:
            _check_int(self, "best_of", low=self.n, high=64)
        if self.use_beam_search:
            if self.n > self.beam_width:
                raise InvalidRequestError(f"n ({self.n}) must be <= beam_width ({self.beam_width})", "n")
            if self.best_of is not None or self.stop:
                raise InvalidRequestError("beam search takes neither best_of nor stop strings", "use_beam_search")

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
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameter(s): {', '.join(unknown)}", unknown[0])
        return cls(**data)


def _check_int(params: SamplingParams, name: str, low: int, high: int | None = None) -> None:
    value = getattr(params, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", name)
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidRequestError(f"{name} must be {bound}, got {value}", name)


def _check_float(
    params: SamplingParams, name: str, low: float, high: float, low_open: bool = False
) -> None:
    value = getattr(params, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", name)
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise InvalidRequestError(f"{name} must be in {bracket}{low}, {high}], got {value}", name)
