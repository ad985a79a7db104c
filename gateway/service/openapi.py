"""The OpenAPI 3.1 description served at ``/openapi.json``: the request bodies generated from the
models the gateway validates with (``gateway/bodies/openai.py``: fields not listed are accepted and ignored,
as vLLM does; schemathesis checks that valid bodies pass and invalid ones are refused), with this
gateway's own caps (``Limits``), the served model's vocabulary bounding token ids and its name; and
the bodies of the answers (``gateway/bodies/answers.py``)."""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from pagedserve.gateway.bodies.answers import ANSWERS
from pagedserve.gateway.bodies.anthropic import MessagesRequest
from pagedserve.gateway.bodies.openai import TOKEN_ID, ChatRequest, CompletionRequest
from pagedserve.gateway.bodies.parse import Limits
from pagedserve.gateway.bodies.responses import ResponsesRequest
from pagedserve.gateway.bodies.validation import REQUESTS
from pagedserve.shared.sampling import MAX_TOKEN_ID

_ERROR_CODES = ("400", "401", "404", "413", "429", "503", "504")
_ERRORS = {code: {"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
           for code in _ERROR_CODES}
_ANTHROPIC_ERRORS = {code: {"description": "error", "content": {"application/json": {"schema": {
    "$ref": "#/components/schemas/AnthropicError"}}}} for code in _ERROR_CODES}


_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "one JSON chunk of the answer's object (as a chunk), or [DONE] last"}}}


def _ok(schema: str | None, streams: bool = False) -> dict:
    if schema is None:
        return {"200": {"description": "ok"}}
    content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}
    if streams:  # stream=true: chunks of the same objects, as server-sent events
        content["text/event-stream"] = {"schema": _SSE_EVENT}  # before OpenAPI 3.2 the schema is one event's
    return {"200": {"description": "ok", "content": content}}


def _post(summary: str, schema: str, response: str | None, streams: bool = False, errors: dict = _ERRORS) -> dict:
    """``response`` None: the answer is a line of text (vLLM's adapter endpoints answer so)."""
    answer = _ok(response, streams) if response is not None else {"200": {"description": "ok", "content": _TEXT},
                                                                   "202": {"description": "accepted", "content": _TEXT}}
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{schema}"}}}}, "responses": {**answer, **errors}}}


_TEXT = {"text/plain": {"schema": {"type": "string"}}}


def _by_id(method: str, summary: str, response: str) -> dict:
    parameter = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    return {method: {"summary": summary, "parameters": [parameter], "responses": {**_ok(response), "404": _ERRORS["404"]}}}


def _get(summary: str, response: str | None = None) -> dict:
    return {"get": {"summary": summary, "responses": {**_ok(response), "503": {"description": "not ready"}}}}


def body_schemas(vocab_size: int, limits: Limits, served_model: str | None) -> dict[str, Any]:
    """The request and answer bodies' schemas (and the ones inside them), by name: the models' own, token ids
    below ``vocab_size``, the gateway's caps on counts and lengths (``Limits``), the model named when known."""
    models = (*REQUESTS, *ANSWERS)
    _, top = models_json_schema([(model, "validation") for model in models], ref_template="#/components/schemas/{model}")
    schemas = top["$defs"]
    _bound_token_ids(schemas, vocab_size)
    caps = {"n": limits.max_n, "best_of": limits.max_n, "beam_width": limits.max_n, "max_tokens": limits.max_tokens,
            "max_completion_tokens": limits.max_tokens, "max_output_tokens": limits.max_tokens}
    for name in (CompletionRequest.__name__, ChatRequest.__name__, MessagesRequest.__name__, ResponsesRequest.__name__):
        properties = schemas[name]["properties"]
        for field, cap in caps.items():
            if field in properties:
                bounded = properties[field]["anyOf"][0] if "anyOf" in properties[field] else properties[field]
                bounded["maximum"] = min(cap, bounded.get("maximum", cap))
        if served_model is not None:
            properties["model"] = {"type": "string", "enum": [served_model]}
    return schemas


def _bound_token_ids(schema: Any, vocab_size: int) -> None:
    """Every schema marked as a prompt's token id (``bodies.openai.TOKEN_ID``) below ``vocab_size``."""
    if isinstance(schema, dict):
        if schema.pop(TOKEN_ID, False):
            schema["maximum"] = vocab_size - 1
        for value in schema.values():
            _bound_token_ids(value, vocab_size)
    elif isinstance(schema, list):
        for value in schema:
            _bound_token_ids(value, vocab_size)


def openapi_spec(vocab_size: int = MAX_TOKEN_ID, limits: Limits = Limits(), served_model: str | None = None) -> dict:
    """The description for a model with ``vocab_size`` token ids, behind a gateway with ``limits``;
    ``served_model`` names the gateway's own model (other workers on the same Redis may serve more,
    which ``/v1/models`` lists: they are valid too, though the spec cannot know them)."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "pagedserve", "version": "1", "description": "OpenAI-compatible API of a pagedserve gateway."},
        "paths": {
            "/v1/completions": _post("Create a completion", "CompletionRequest", "CompletionResponse", streams=True),
            "/v1/chat/completions": _post("Create a chat completion", "ChatRequest", "ChatResponse", streams=True),
            "/v1/messages": _post("Create a message (Anthropic's Messages API)", "MessagesRequest", "AnthropicMessage",
                                  streams=True, errors=_ANTHROPIC_ERRORS),
            "/v1/embeddings": _post("Create embeddings (the final hidden states pooled and normalised)", "EmbeddingsRequest",
                                    "EmbeddingList"),
            "/v1/responses": _post("Create a response (OpenAI's Responses API)", "ResponsesRequest", "Response", streams=True),
            "/v1/responses/{response_id}": {**_by_id("get", "Retrieve a stored response", "Response"),
                                            **_by_id("delete", "Delete a stored response", "DeletedResponse")},
            "/v1/models": _get("Models with live workers", "ModelList"),
            "/health": _get("Liveness"),
            "/ready": _get("Redis reachable and a worker alive"),
            "/metrics": _get("Prometheus metrics"),
            "/version": _get("The pagedserve version", "Version"),
            "/tokenize": _post("Token ids of a prompt or chat, as a generation request would send them", "TokenizeRequest",
                               "TokenizeResponse"),
            "/detokenize": _post("Text of token ids", "DetokenizeRequest", "DetokenizeResponse"),
            "/v1/load_lora_adapter": _post("Load a LoRA adapter on every worker of the model (vLLM's run-time API); "
                                           "200 once each holds it", "LoadLoraAdapterRequest", None),
            "/v1/unload_lora_adapter": _post("Unload a LoRA adapter from every worker of the model; 202 while requests "
                                             "still run under it", "UnloadLoraAdapterRequest", None),
        },
        "components": {"schemas": {
            **body_schemas(vocab_size, limits, served_model),
        }},
    }


OPENAPI = openapi_spec()
