"""StructuredOutputs: what a generation must match (a JSON schema, any JSON object, a regex, one of
a list of strings, or a grammar), its shape checked at construction.

One of ``json``, ``json_object``, ``regex``, ``choice``, ``grammar`` is set (the names vLLM's
``StructuredOutputsParams`` uses). A schema given as a dict is kept as canonical JSON text, so the
value is hashable and equal schemas share a compiled grammar (key order is kept: it is the order
the properties are generated in). Grammars are
llguidance's: ``grammar`` takes EBNF (llama.cpp's GBNF) or Lark. JSON is generated compact (no
whitespace between tokens: a model cannot pad it forever) and strict (RFC 8259: no raw control
characters in strings). A malformed value raises ``InvalidRequestError`` naming ``structured``.
Whether the schema, regex or grammar itself is valid is llguidance's to say, and costs a grammar
build: the gateway checks it once per request off its event loop
(``runtime/structured_grammar.py``), the worker compiles it once (``worker/runner/sampling/structured_masks.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from pagedserve.shared.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256


@dataclass(frozen=True)
class StructuredOutputs:
    json: str | None = None  # a JSON schema (dicts are stored as canonical JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # EBNF (GBNF) or Lark

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, bool)):
            object.__setattr__(self, "json", json.dumps(self.json, separators=(",", ":")))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        self._check_shape()

    def _check_shape(self) -> None:
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise InvalidRequestError(f"structured output takes exactly one of {', '.join(KINDS)}; got {set_ or 'none'}",
                                      "structured")
        kind = set_[0]
        value = getattr(self, kind)
        if kind == "json_object" and value is not True:
            raise InvalidRequestError("structured json_object must be true", "structured")
        if kind == "choice":
            if not (isinstance(value, tuple) and 0 < len(value) <= MAX_CHOICES and all(isinstance(c, str) and c for c in value)):
                raise InvalidRequestError(f"structured choice must be 1 to {MAX_CHOICES} non-empty strings", "structured")
        elif kind != "json_object" and not isinstance(value, str):
            raise InvalidRequestError(f"structured {kind} must be a string", "structured")
        if len(self.key[1]) > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"structured {kind} is longer than {MAX_SPEC_CHARS} characters", "structured")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): equal for equal constraints; compiled grammars are cached under it."""
        value = getattr(self, self.kind)
        if self.kind == "choice":
            return "choice", json.dumps(list(value))
        return self.kind, "true" if value is True else value

    def to_dict(self) -> dict[str, Any]:
        kind = self.kind
        value = getattr(self, kind)
        return {kind: list(value) if kind == "choice" else value}

    @classmethod
    def from_dict(cls, data: Any) -> "StructuredOutputs":
        if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
            raise InvalidRequestError("structured must be a map with one of " + ", ".join(KINDS), "structured")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise InvalidRequestError(f"structured: unknown key(s) {', '.join(unknown)}", "structured")
        return cls(**data)

