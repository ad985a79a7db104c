"""The request fields that ask for structured output, OpenAI's and vLLM's, -> ``StructuredOutputs``.

- ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``, or
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` (no schema: any JSON);
- vLLM's ``structured_outputs``: ``{"json" | "json_object" | "regex" | "choice" | "grammar": ...}``;
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

At most one of them per request; every problem is a 400 naming the field (their shapes:
``gateway/bodies/openai.py``).
"""

from __future__ import annotations

from typing import Any

from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.structured import StructuredOutputs

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
FIELDS = ("response_format", "structured_outputs", *GUIDED)


def structured_outputs(req: Any, error) -> tuple[StructuredOutputs | None, str | None]:
    """The constraint a validated request (``bodies.openai.Sampling``: each field's shape already checked)
    asks for and the field that asked (the one a 400 about it names, also when the gateway's later
    check finds llguidance refuses it). ``error(message, param)`` builds the exception to raise
    (the gateway's ApiError)."""
    asked = {name: getattr(req, name) for name in FIELDS if getattr(req, name) is not None}
    if "response_format" in asked and asked["response_format"].type == "text":
        asked.pop("response_format")
    if len(asked) > 1:
        raise error(f"ask for structured output once: got {', '.join(sorted(asked))}", sorted(asked)[1])
    if not asked:
        return None, None
    (name, value), = asked.items()
    try:
        if name == "response_format":
            if value.type == "json_object":
                return StructuredOutputs(json_object=True), name
            return StructuredOutputs(json=value.json_schema.schema_ or {}), name  # no schema: any JSON
        if name == "structured_outputs":
            return StructuredOutputs.from_dict(value.model_dump(by_alias=True, exclude_none=True)), name
        return StructuredOutputs(**{GUIDED[name]: value}), name
    except InvalidRequestError as err:
        raise error(str(err), name) from None
