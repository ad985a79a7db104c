"""The request fields that ask for structured output, OpenAI's and vLLM's, -> ``StructuredOutputs``.

- ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``, or
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` (no schema: any JSON);
- vLLM's ``structured_outputs``: ``{"json" | "json_object" | "regex" | "choice" | "grammar": ...}``;
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

At most one of them per request; every problem is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.structured import StructuredOutputs

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
FIELDS = frozenset({"response_format", "structured_outputs", *GUIDED})


def structured_outputs(body: dict, error) -> tuple[StructuredOutputs | None, str | None]:
    """The constraint asked for and the field that asked (the one a 400 about it names, also when
    the gateway's later check finds llguidance refuses it). ``error(message, param)`` builds the
    exception to raise (the gateway's ApiError)."""
    asked = {name: body[name] for name in FIELDS if body.get(name) is not None}
    if asked.get("response_format") == {"type": "text"}:
        asked.pop("response_format")
    if len(asked) > 1:
        raise error(f"ask for structured output once: got {', '.join(sorted(asked))}", sorted(asked)[1])
    if not asked:
        return None, None
    (name, value), = asked.items()
    try:
        if name == "response_format":
            return _response_format(value, error), name
        if name == "structured_outputs":
            return StructuredOutputs.from_dict(value), name
        return StructuredOutputs(**{GUIDED[name]: value}), name
    except InvalidRequestError as err:
        raise error(str(err), name) from None
    except TypeError:
        raise error(f"{name} has the wrong type", name) from None


def _response_format(value: Any, error) -> StructuredOutputs:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
            raise error("response_format.json_schema must be an object with a name and a schema", "response_format")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise error("response_format.json_schema.schema must be a JSON schema object", "response_format")
        return StructuredOutputs(json=schema)
    raise error('response_format.type must be "text", "json_object" or "json_schema"', "response_format")
