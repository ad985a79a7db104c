"""Response bodies of ``/openapi.json``, as JSON Schema (self-contained: no ``$ref`` inside, so a
test can check live responses against them directly)."""

from __future__ import annotations

_INT = {"type": "integer"}
_STR = {"type": "string"}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT}}
_HEAD = {"id": _STR, "object": _STR, "created": _INT, "model": _STR}
_FINISH = {"type": ["string", "null"], "enum": ["stop", "length", "abort", "error", None]}


def _choices(body: dict) -> dict:
    return {"type": "array", "items": {"type": "object", "required": ["index", "finish_reason", *body],
                                       "properties": {"index": _INT, "finish_reason": _FINISH,
                                                      "logprobs": {"type": ["object", "null"]}, **body}}}


RESPONSES = {
    "CompletionResponse": {"type": "object", "required": [*_HEAD, "choices", "usage"], "properties": {
        **_HEAD, "choices": _choices({"text": _STR}), "usage": _USAGE}},
    "ChatResponse": {"type": "object", "required": [*_HEAD, "choices", "usage"], "properties": {
        **_HEAD, "usage": _USAGE, "choices": _choices({"message": {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"const": "assistant"}, "content": _STR}}})}},
    "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": {
            "type": "object", "required": ["id", "object", "created", "owned_by"],
            "properties": {"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR,
                           "max_model_len": _INT}}}}},
    "TokenizeResponse": {"type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
        "count": _INT, "tokens": {"type": "array", "items": _INT},
        "max_model_len": {"type": ["integer", "null"], "description": "the live workers' context; null while none serves"}}},
    "DetokenizeResponse": {"type": "object", "required": ["prompt"], "properties": {"prompt": _STR}},
    "Version": {"type": "object", "required": ["version"], "properties": {"version": _STR}},
    "AnthropicMessage": {"type": "object", "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"],
                         "properties": {
        "id": _STR, "type": {"const": "message"}, "role": {"const": "assistant"}, "model": _STR,
        "content": {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["text", "thinking", "tool_use"]}, "text": _STR, "thinking": _STR, "id": _STR, "name": _STR,
            "input": {"type": "object"}}}},
        "stop_reason": {"type": ["string", "null"], "enum": ["end_turn", "max_tokens", "tool_use", "stop_sequence", None]},
        "stop_sequence": {"type": ["string", "null"]},
        "usage": {"type": "object", "required": ["input_tokens", "output_tokens"],
                  "properties": {"input_tokens": _INT, "output_tokens": _INT}}}},
    "Response": {"type": "object", "required": ["id", "object", "created_at", "status", "model", "output", "usage"],
                 "properties": {
        "id": _STR, "object": {"const": "response"}, "created_at": _INT, "model": _STR,
        "status": {"enum": ["completed", "incomplete", "in_progress"]},
        "output": {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["message", "function_call", "reasoning"]}, "id": _STR}}},
        "previous_response_id": {"type": ["string", "null"]},
        "usage": {"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens"], "properties": {
            "input_tokens": _INT, "output_tokens": _INT, "total_tokens": _INT}}}},
    "EmbeddingList": {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
        "object": {"const": "list"}, "model": _STR,
        "data": {"type": "array", "items": {"type": "object", "required": ["object", "index", "embedding"], "properties": {
            "object": {"const": "embedding"}, "index": _INT,
            "embedding": {"oneOf": [{"type": "array", "items": {"type": "number"}}, _STR]}}}},
        "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"], "properties": {
            "prompt_tokens": _INT, "total_tokens": _INT}}}},
    "DeletedResponse": {"type": "object", "required": ["id", "object", "deleted"], "properties": {
        "id": _STR, "object": {"const": "response"}, "deleted": {"const": True}}},
    "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
            "type": _STR, "message": _STR}}}},
}
