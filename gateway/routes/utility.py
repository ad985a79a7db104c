"""The endpoints around generation that vLLM users script against: ``/tokenize``, ``/detokenize``,
``/version`` and ``/v1/models``. Same tokenizer, chat template and validation as the generation
routes, so ``/tokenize`` counts exactly what a request of the same body would send."""

from __future__ import annotations

from aiohttp import web

from pagedserve.gateway.bodies.openai import DetokenizeRequest, TokenizeRequest
from pagedserve.gateway.bodies.parse import ApiError, chat_messages
from pagedserve.gateway.bodies.validation import validated
from pagedserve.gateway.service.generation import STATE, read_json
from pagedserve.runtime.version import installed_version
from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.prompts import check_token_ids


async def _body(request: web.Request) -> dict:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    served = request.app[STATE].settings.served_model_name
    if model is not None and model != served:
        raise ApiError(404, f"the model {model!r} does not exist", "model", "model_not_found")
    return body


async def tokenize(request: web.Request) -> web.Response:
    """``{"prompt": …}`` or ``{"messages": […]}`` -> ``{"count", "max_model_len", "tokens"}``."""
    state = request.app[STATE]
    body = validated(TokenizeRequest, await _body(request))
    given = sorted({"messages", "prompt"} & body.model_fields_set)
    if len(given) != 1 or getattr(body, given[0]) is None:
        raise ApiError(400, "tokenize takes either prompt (a string or a list of token ids) or messages", "prompt")
    chat = given == ["messages"]
    prompt = chat_messages(body.messages) if chat else body.prompt
    try:
        tokens = check_token_ids((await state.encode(prompt, chat, body.chat_template_kwargs))[0], len(state.tokenizer))
    except InvalidRequestError as err:
        raise ApiError(400, str(err), "prompt") from None
    return web.json_response({"count": len(tokens), "max_model_len": await state.context_limit(), "tokens": tokens})


async def detokenize(request: web.Request) -> web.Response:
    """``{"tokens": [ids]}`` -> ``{"prompt": text}``."""
    state = request.app[STATE]
    body = validated(DetokenizeRequest, await _body(request))
    try:
        ids = check_token_ids(body.tokens, len(state.tokenizer), "tokens")
    except InvalidRequestError as err:
        raise ApiError(400, str(err), err.field) from None
    return web.json_response({"prompt": state.tokenizer.decode(ids)})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": installed_version()})


async def models(request: web.Request) -> web.Response:
    """The models live workers serve; the one this gateway fronts also says its context length, and
    is followed by the LoRA adapters its workers hold (``parent``: the model)."""
    state = request.app[STATE]
    data = []
    for name in await state.live_models():
        entry = {"id": name, "object": "model", "created": 0, "owned_by": "pagedserve", "root": name, "parent": None}
        data.append(entry)
        if name == state.settings.served_model_name:
            workers = await state.workers.workers(name)
            entry["max_model_len"] = workers.context_limit
            entry["kv_cache_dtype"] = ",".join(workers.kv_cache_dtypes)  # the live workers' (one, unless mixed)
            data.extend({"id": adapter, "object": "model", "created": 0, "owned_by": "pagedserve", "root": adapter,
                         "parent": name} for adapter in workers.adapters)  # LoRA adapters, as vLLM lists them
    return web.json_response({"object": "list", "data": data})
