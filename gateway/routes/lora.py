"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (vLLM's run-time adapter
API). The model's adapter registry in Redis (``Keys.adapters``: name -> path) is changed, and every
worker of the model follows it at its next heartbeat (``worker/serve/adapter_sync.py``); the answer
comes once every live worker with LoRA on holds the adapter (or none does), as their ``WorkerInfo``
says; where no worker has LoRA on, a load is a 400 at once. A worker
that cannot read the adapter writes why (``Keys.adapter_errors``): the registry entry is taken back
and the answer is a 400 with that reason. Unloading waits for requests running under the adapter:
past ``WAIT_S`` the answer is a 202 (each worker unloads it when they end)."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from pagedserve.gateway.bodies.openai import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from pagedserve.gateway.bodies.parse import ApiError
from pagedserve.gateway.bodies.validation import validated
from pagedserve.gateway.service.generation import STATE, read_json

WAIT_S = 30.0  # for every worker to follow the registry (a heartbeat, and reading the adapter)
POLL_S = 0.2


async def load_lora_adapter(request: web.Request) -> web.Response:
    """``{"lora_name", "lora_path"}``: every worker of the model reads the PEFT adapter at ``lora_path``."""
    state = request.app[STATE]
    body = validated(LoadLoraAdapterRequest, await read_json(request))
    name, path = body.lora_name, body.lora_path
    model = state.settings.served_model_name
    registry, errors = state.keys.adapters(model), state.keys.adapter_errors(model)
    if not await state.serving():
        raise ApiError(503, f"no worker is serving {model!r} right now", None, "no_worker", "service_unavailable",
                       {"Retry-After": "5"})
    if not any(w.max_loras for w in (await state.workers.workers(model)).infos):
        raise ApiError(400, f"no worker of {model!r} serves LoRA adapters (start them with --enable-lora)", "lora_name")
    if name == model or await state.redis.hexists(registry, name) or await state.serves_adapter(name):
        raise ApiError(400, f"the LoRA adapter {name!r} is already loaded (unload it first)", "lora_name")
    await state.redis.hdel(errors, name)
    await state.redis.hset(registry, name, path)
    deadline = time.monotonic() + WAIT_S
    while True:
        error = await state.redis.hget(errors, name)
        if error is not None:
            await state.redis.hdel(registry, name)
            await state.redis.hdel(errors, name)
            raise ApiError(400, error.decode(errors="replace"), "lora_path")
        infos = [w for w in (await state.workers.workers(model)).infos if w.max_loras]  # the rest never load one
        if infos and all(w.holds_adapter(name) for w in infos):
            return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")
        if time.monotonic() > deadline:
            raise ApiError(504, f"the LoRA adapter {name!r} is not on every worker after {WAIT_S:.0f} s; it stays in "
                                "the registry and the rest load it at their next heartbeat", None, "timeout", "timeout")
        await asyncio.sleep(POLL_S)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """``{"lora_name"}``: every worker of the model forgets the adapter."""
    state = request.app[STATE]
    name = validated(UnloadLoraAdapterRequest, await read_json(request)).lora_name
    model = state.settings.served_model_name
    removed = await state.redis.hdel(state.keys.adapters(model), name)
    if not removed and not await state.serves_adapter(name):
        raise ApiError(404, f"no LoRA adapter named {name!r} is loaded", "lora_name", "model_not_found")
    deadline = time.monotonic() + WAIT_S
    while name in (await state.workers.workers(model)).adapters:
        if time.monotonic() > deadline:
            return web.Response(status=202, text=f"Unloading LoRA adapter '{name}': requests still run under it; "
                                                 "each worker unloads it when they end.")
        await asyncio.sleep(POLL_S)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
