"""The OpenAPI 3.1 description served at ``/openapi.json``: request bodies exactly as the gateway
validates them (fields not listed are accepted and ignored, as vLLM does; schemathesis checks that
valid bodies pass and invalid ones are refused), and the bodies of the answers. Numeric ranges come
from ``shared.sampling.BOUNDS``, the table ``SamplingParams`` checks; token ids are bounded by the
served model's vocabulary (``openapi_spec(vocab_size)``)."""

from __future__ import annotations

from pagedserve.gateway.openapi_responses import RESPONSES
from pagedserve.gateway.schemas import MAX_USER_LEN, PRIORITY_RANGE, Limits
from pagedserve.shared.sampling import BOUNDS, MAX_TOKEN_ID, NOT_REQUEST_FIELDS

_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": 256}
_BOUNDED = {name: bound.json_schema() for name, bound in BOUNDS.items()
            if name not in ("logprobs", "best_of") and name not in NOT_REQUEST_FIELDS}
_SAMPLING = {
    **_BOUNDED,
    "stop": {"oneOf": [_STOP_STRING, {"type": "array", "items": _STOP_STRING, "maxItems": 4}]},
    "stream": {"type": "boolean"}, "stream_options": {"type": "object", "properties": {
        "include_usage": {"type": ["boolean", "null"]}, "continuous_usage_stats": {"type": ["boolean", "null"]}}},
    "user": {"type": "string", "maxLength": MAX_USER_LEN},
    "priority": {"type": "integer", "minimum": PRIORITY_RANGE[0], "maximum": PRIORITY_RANGE[1]}, "timeout": {"type": "number", "exclusiveMinimum": 0, "maximum": 3600},
    "ignore_eos": {"type": "boolean"}, "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID - 1}},
    "use_beam_search": {"type": "boolean"},
    # Structured outputs (gateway/structured_fields.py): at most one of these per request.
    "response_format": {"oneOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {"type": {"const": "json_schema"},
         "json_schema": {"type": "object", "properties": {"name": {"type": "string"}, "schema": {"type": "object"}}}}}]},
    "structured_outputs": {"type": "object", "minProperties": 1, "maxProperties": 1, "properties": {
        "json": {"type": ["object", "string"]}, "json_object": {"const": True}, "regex": {"type": "string"},
        "choice": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}, "grammar": {"type": "string"}},
        "additionalProperties": False},
    "guided_json": {"type": ["object", "string"]}, "guided_regex": {"type": "string"}, "guided_grammar": {"type": "string"},
    "guided_choice": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
    "early_stopping": {"oneOf": [{"type": "boolean"}, {"type": "string", "enum": ["never"]}]},
}


# Beam search takes neither best_of nor stop strings (the other cross-field rules, min_tokens <=
# max_tokens, best_of >= n, n <= beam_width, are beyond JSON Schema: the gateway's 400 names them).
_BEAM_RULE = {"if": {"required": ["use_beam_search"], "properties": {"use_beam_search": {"const": True}}},
              "then": {"properties": {"best_of": {"type": "null"}, "stop": {"anyOf": [
                  {"type": "null"}, {"type": "array", "maxItems": 0}]}}}}
# Chat: top_logprobs (not null) only with logprobs: true.
_TOP_LOGPROBS_RULE = {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"not": {"type": "null"}}}},
                      "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}


def _nullable(properties: dict) -> dict:
    """Every sampling field may be null: the gateway reads null as "not set" (as OpenAI's spec has it)."""
    return {name: {"anyOf": [schema, {"type": "null"}]} for name, schema in properties.items()}


def _ids(vocab_size: int) -> dict:
    return {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}


def _prompt(vocab_size: int) -> dict:
    text = {"type": "string", "minLength": 1}
    return {"oneOf": [text, {"type": "array", "minItems": 1, "items": text}, _ids(vocab_size),
                      {"type": "array", "minItems": 1, "items": _ids(vocab_size)}]}


_TEXT_PART = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
_CONTENT = [{"type": "string"}, {"type": "array", "minItems": 1, "items": _TEXT_PART}]
_MESSAGES = {"type": "array", "minItems": 1, "items": {"oneOf": [  # only an assistant message may have no content
    {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["system", "user", "developer"]}, "content": {"oneOf": _CONTENT}}},
    {"type": "object", "required": ["role"], "properties": {
        "role": {"const": "assistant"}, "content": {"oneOf": [*_CONTENT, {"type": "null"}]},
        "tool_calls": {"type": ["array", "null"], "items": {"type": "object", "required": ["function"], "properties": {
            "id": {"type": "string"}, "type": {"const": "function"}, "function": {
                "type": "object", "required": ["name"], "properties": {"name": {"type": "string"},
                                                                       "arguments": {"type": "string"}}}}}}}},
    {"type": "object", "required": ["role", "content", "tool_call_id"], "properties": {
        "role": {"const": "tool"}, "content": {"oneOf": _CONTENT}, "tool_call_id": {"type": "string"}}},
]}}
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {"type": {"const": "function"}, "function": {
    "type": "object", "required": ["name"], "properties": {"name": {"type": "string", "minLength": 1},
                                                           "description": {"type": "string"},
                                                           "parameters": {"type": "object"}}}}}
_TOOL_FIELDS = {  # tools need a unique name each; a named tool_choice must be one of them (checked by the gateway)
    "tools": {"type": "array", "maxItems": 128, "items": _TOOL},
    "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, {
        "type": "object", "required": ["type", "function"], "properties": {
            "type": {"const": "function"}, "function": {"type": "object", "required": ["name"],
                                                         "properties": {"name": {"type": "string"}}}}}]},
    "parallel_tool_calls": {"type": "boolean"},
}
_ERROR = {"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_ERRORS = {code: _ERROR for code in ("400", "401", "404", "413", "429", "503", "504")}


_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "one JSON chunk of the answer's object (as a chunk), or [DONE] last"}}}


def _ok(schema: str | None, streams: bool = False) -> dict:
    if schema is None:
        return {"200": {"description": "ok"}}
    content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}
    if streams:  # stream=true: chunks of the same objects, as server-sent events
        content["text/event-stream"] = {"schema": _SSE_EVENT}  # before OpenAPI 3.2 the schema is one event's
    return {"200": {"description": "ok", "content": content}}


def _post(summary: str, schema: str, response: str, streams: bool = False) -> dict:
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{schema}"}}}}, "responses": {**_ok(response, streams), **_ERRORS}}}


def _get(summary: str, response: str | None = None) -> dict:
    return {"get": {"summary": summary, "responses": {**_ok(response), "503": {"description": "not ready"}}}}


def openapi_spec(vocab_size: int = MAX_TOKEN_ID, limits: Limits = Limits(), served_model: str | None = None) -> dict:
    """The description for a model with ``vocab_size`` token ids, behind a gateway with ``limits``;
    ``served_model`` names the gateway's own model (other workers on the same Redis may serve more,
    which ``/v1/models`` lists: they are valid too, though the spec cannot know them)."""
    prompt = _prompt(vocab_size)
    model = {"type": "string"} if served_model is None else {"type": "string", "enum": [served_model]}
    caps = {"n": limits.max_n, "best_of": limits.max_n, "beam_width": limits.max_n, "max_tokens": limits.max_tokens}
    capped = {name: {**BOUNDS[name].json_schema(), "maximum": min(cap, BOUNDS[name].high or cap)} for name, cap in caps.items()}
    sampling = _nullable({**_SAMPLING, **{k: v for k, v in capped.items() if k != "best_of"}})
    sampling["model"] = model
    optional_model = {"type": ["string", "null"]}  # the utility routes default to the served model
    return {
        "openapi": "3.1.0",
        "info": {"title": "pagedserve", "version": "1", "description": "OpenAI-compatible API of a pagedserve gateway."},
        "paths": {
            "/v1/completions": _post("Create a completion", "CompletionRequest", "CompletionResponse", streams=True),
            "/v1/chat/completions": _post("Create a chat completion", "ChatRequest", "ChatResponse", streams=True),
            "/v1/models": _get("Models with live workers", "ModelList"),
            "/health": _get("Liveness"),
            "/ready": _get("Redis reachable and a worker alive"),
            "/metrics": _get("Prometheus metrics"),
            "/version": _get("The pagedserve version", "Version"),
            "/tokenize": _post("Token ids of a prompt or chat, as a generation request would send them", "TokenizeRequest",
                               "TokenizeResponse"),
            "/detokenize": _post("Text of token ids", "DetokenizeRequest", "DetokenizeResponse"),
        },
        "components": {"schemas": {
            **RESPONSES,
            "CompletionRequest": {"type": "object", "required": ["model", "prompt"], "allOf": [_BEAM_RULE], "properties": {
                **sampling, **_nullable({"logprobs": BOUNDS["logprobs"].json_schema(), "best_of": capped["best_of"],
                                         "echo": {"type": "boolean"}}),
                "prompt": prompt}},
            "ChatRequest": {"type": "object", "required": ["model", "messages"], "allOf": [_BEAM_RULE, _TOP_LOGPROBS_RULE],
                            "properties": {
                **sampling, **_nullable({"max_completion_tokens": capped["max_tokens"], "logprobs": {"type": "boolean"},
                                         "top_logprobs": BOUNDS["logprobs"].json_schema(), **_TOOL_FIELDS}),
                "messages": _MESSAGES}},
            "TokenizeRequest": {"type": "object", "oneOf": [{"required": ["messages"]}, {"required": ["prompt"]}],
                                "properties": {"model": optional_model, "messages": _MESSAGES, "prompt": {
                                    "oneOf": [{"type": "string", "minLength": 1}, _ids(vocab_size)]}}},
            "DetokenizeRequest": {"type": "object", "required": ["tokens"], "properties": {
                "model": optional_model, "tokens": {**_ids(vocab_size), "minItems": 0}}},
            "Error": {"type": "object", "properties": {"error": {"type": "object", "properties": {
                "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]}}}}},
        }},
    }


OPENAPI = openapi_spec()
