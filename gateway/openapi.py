"""The OpenAPI 3.1 description served at ``/openapi.json`` (request bodies as the gateway validates
them; fields not listed are accepted and ignored, as vLLM does). Numeric ranges come from ``shared.sampling.BOUNDS``, the table ``SamplingParams`` checks."""

from __future__ import annotations

from gateway.openapi_responses import RESPONSES
from gateway.schemas import MAX_USER_LEN, PRIORITY_RANGE
from shared.sampling import BOUNDS, MAX_TOKEN_ID

_BOUNDED = {name: bound.json_schema() for name, bound in BOUNDS.items() if name not in ("logprobs", "best_of")}
_SAMPLING = {
    **_BOUNDED, "model": {"type": "string"},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
    "stream": {"type": "boolean"}, "stream_options": {"type": "object", "properties": {
        "include_usage": {"type": "boolean"}, "continuous_usage_stats": {"type": "boolean"}}},
    "user": {"type": "string", "maxLength": MAX_USER_LEN},
    "priority": {"type": "integer", "minimum": PRIORITY_RANGE[0], "maximum": PRIORITY_RANGE[1]}, "timeout": {"type": "number", "exclusiveMinimum": 0, "maximum": 3600},
    "ignore_eos": {"type": "boolean"}, "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID - 1}},
    "use_beam_search": {"type": "boolean"},
    "early_stopping": {"oneOf": [{"type": "boolean"}, {"type": "string", "enum": ["never"]}]},
}
_PROMPT = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}},
                     {"type": "array", "items": {"type": "integer"}}]}
_TEXT_PART = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
_MESSAGES = {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role"], "properties": {
    "role": {"type": "string", "enum": ["system", "user", "assistant", "developer"]},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": _TEXT_PART}, {"type": "null"}]}}}}
_ERROR = {"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_ERRORS = {code: _ERROR for code in ("400", "401", "404", "413", "429", "503", "504")}


def _ok(schema: str | None, streams: bool = False) -> dict:
    if schema is None:
        return {"200": {"description": "ok"}}
    content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}
    if streams:  # stream=true: chunks of the same objects, as server-sent events
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return {"200": {"description": "ok", "content": content}}


def _post(summary: str, schema: str, response: str, streams: bool = False) -> dict:
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{schema}"}}}}, "responses": {**_ok(response, streams), **_ERRORS}}}


def _get(summary: str, response: str | None = None) -> dict:
    return {"get": {"summary": summary, "responses": {**_ok(response), "503": {"description": "not ready"}}}}


OPENAPI = {
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
        "CompletionRequest": {"type": "object", "required": ["model", "prompt"], "properties": {
            **_SAMPLING, "logprobs": BOUNDS["logprobs"].json_schema(), "best_of": BOUNDS["best_of"].json_schema(),
            "prompt": _PROMPT}},
        "ChatRequest": {"type": "object", "required": ["model", "messages"], "properties": {
            **_SAMPLING, "max_completion_tokens": BOUNDS["max_tokens"].json_schema(), "logprobs": {"type": "boolean"},
            "top_logprobs": BOUNDS["logprobs"].json_schema(),
            "messages": _MESSAGES}},
        "TokenizeRequest": {"type": "object", "properties": {"model": {"type": "string"}, "prompt": _PROMPT,
                                                             "messages": _MESSAGES}},
        "DetokenizeRequest": {"type": "object", "required": ["tokens"], "properties": {
            "model": {"type": "string"}, "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}},
        "Error": {"type": "object", "properties": {"error": {"type": "object", "properties": {
            "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]}}}}},
    }},
}
