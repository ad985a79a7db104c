"""A ``StructuredOutputs`` as an llguidance grammar, and whether llguidance accepts it: the one
translation the gateway (``check_structured``, once per request, off its event loop) and the
worker (its compiler, once per distinct constraint) both use. JSON is generated compact and
strict (``shared/structured.py`` says why)."""

from __future__ import annotations

from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.structured import StructuredOutputs

JSON_OPTIONS = {"whitespace_flexible": False}  # compact output, as json.dumps(separators=(",", ":"))


def grammar_text(structured: StructuredOutputs) -> str:
    """The constraint as an llguidance grammar; InvalidRequestError naming ``structured`` when it
    cannot be one."""
    from llguidance import LLMatcher, grammar_from

    kind, text = structured.key
    if kind in ("json", "json_object"):
        schema = text if kind == "json" else '{"type": "object"}'
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as err:
            raise InvalidRequestError(f"structured output (json): {err}", "structured") from None
    try:
        return grammar_from(kind, text)
    except ValueError as err:
        raise InvalidRequestError(f"structured output ({kind}): {err}", "structured") from None


def check_structured(structured: StructuredOutputs) -> None:
    """InvalidRequestError (with llguidance's reason) unless the constraint makes a valid grammar."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar_text(structured))
    if is_error:
        raise InvalidRequestError(f"structured output ({structured.kind}): {' '.join(messages[0].split())[:400]}",
                                  "structured")
