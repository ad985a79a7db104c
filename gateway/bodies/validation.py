"""A request body checked against its model (``gateway/bodies/openai.py``,
``gateway/bodies/responses.py``, ``gateway/bodies/anthropic.py``):
the first problem as a 400 that names the field and the place inside it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from pagedserve.gateway.bodies.anthropic import MessagesRequest
from pagedserve.gateway.bodies.openai import BODIES, ROLES
from pagedserve.gateway.bodies.responses import ResponsesRequest
from pagedserve.gateway.http.api_error import ApiError

ERROR_CODES = {"missing": "missing_required_parameter", "unsupported_content_type": "unsupported_content_type"}


def _field_names(models: tuple[type[BaseModel], ...]) -> frozenset[str]:
    """Every field name (as sent: aliases) of ``models`` and the models inside them."""
    names: set[str] = set()
    seen: set[type] = set()
    queue = list(models)
    while queue:
        model = queue.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, info in model.model_fields.items():
            names.add(info.alias or name)
            queue.extend(_models_in(info.annotation))
    return frozenset(names)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in getattr(annotation, "__args__", ()) for model in _models_in(arg)]


REQUESTS = (*BODIES, MessagesRequest, ResponsesRequest)  # every request body the gateway validates
FIELDS = _field_names(REQUESTS)  # names an error's location may hold (the rest: a union's branch tags)


def validated(model: type[BaseModel], body: dict) -> Any:
    """``body`` as ``model`` (gateway/bodies/openai.py), or a 400 naming the field of its first problem."""
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise api_error(err) from None


def api_error(err: ValidationError) -> ApiError:
    """A body's problem as a 400 naming its field (a message's index: ``messages[1]``) and where
    inside it. Of a value that fits none of a field's forms, the form it came closest to (the
    deepest problem) speaks."""
    errors = err.errors(include_url=False)
    unsupported = [e for e in errors if e["type"] == "unsupported_content_type"]
    first = unsupported[0] if unsupported else max(errors, key=lambda e: (len(e["loc"]), not e["type"].endswith("_type")))
    path = _path(first["loc"])
    head = path.split(".")[0]
    param = head if head.startswith("messages[") else head.split("[")[0] or None
    code = ERROR_CODES.get(first["type"]) if first["type"] != "missing" or len(first["loc"]) == 1 else None  # a field of the body
    return ApiError(400, f"{path or 'the body'}: {first['msg']}", param, code)


def _path(loc: tuple) -> str:
    """An error location as the client wrote it (``messages[1].content[0].text``): without a
    union's branch tags (a form's name, not a field) or a message's role (the tag its form is
    chosen by)."""
    path = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in FIELDS and not (i and isinstance(loc[i - 1], int) and part in ROLES):
            path += f".{part}" if path else part
    return path
