"""A worker's LoRA adapters kept to its model's registry (``Keys.adapters``: name -> path), at
each heartbeat: an adapter added there is read (a failure is written under ``Keys.adapter_errors``
for the gateway that asked), one changed is read again, one removed is unloaded once no request runs
under it. The adapters of ``--lora-modules`` go into the registry at start unless it names them
already. Engine calls run on the engine thread, between two steps (``EngineLoop.call``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import structlog

from pagedserve.shared.keys import Keys
from pagedserve.worker.engine import Engine
from pagedserve.worker.runner.lora.peft_adapter import AdapterBusy, LoraError
from pagedserve.worker.serve.loop import EngineLoop

log = structlog.get_logger("pagedserve.worker")


ENGINE_CALL_S = 30.0  # a call waits at most this long for the engine thread (a step, or a stopped loop)


class AdapterSync:
    def __init__(self, redis, keys: Keys, model: str, engine: Engine, engine_loop: EngineLoop,
                 stopping: asyncio.Event) -> None:
        self.redis, self.engine, self.engine_loop, self.stopping = redis, engine, engine_loop, stopping
        self.registry, self.errors = keys.adapters(model), keys.adapter_errors(model)
        self.held: tuple[str, ...] = engine.limits()["adapters"]  # NAME@DIGEST, as WorkerInfo says them
        self._synced: dict[str, str] | None = None  # the registry as this engine last matched it

    async def publish_startup(self, adapters: dict[str, str]) -> None:
        """``--lora-modules`` (name -> path) into the registry, where it does not name them yet."""
        for name, path in adapters.items():
            await self.redis.hsetnx(self.registry, name, str(Path(path)))

    async def sync(self) -> None:
        """Load, reload and unload until this engine holds what the registry says."""
        if self.engine.adapters is None or self.stopping.is_set():  # a draining engine loop may be gone
            return
        wanted = {k.decode(): v.decode() for k, v in (await self.redis.hgetall(self.registry)).items()}
        if wanted == self._synced:
            return
        wanted_paths = {name: str(Path(path)) for name, path in wanted.items()}
        held = {name: path for name, (path, _) in (await self._on_engine(self._loaded)).items()}
        for name, path in wanted.items():
            if held.get(name) != wanted_paths[name]:
                try:
                    await self._on_engine(lambda: self.engine.load_adapter(name, path))
                except AdapterBusy:
                    pass  # a changed path under requests still running: the next heartbeat tries again
                except LoraError as err:
                    log.warning("lora adapter not loaded", name=name, path=path, error=str(err))
                    await self.redis.hsetnx(self.errors, name, str(err))
        for name in set(held) - set(wanted):
            try:
                await self._on_engine(lambda: self.engine.unload_adapter(name))
                log.info("lora adapter unloaded", name=name)
            except AdapterBusy:
                pass  # a request runs under it: the next heartbeat tries again
        loaded = await self._on_engine(self._loaded)
        self.held = tuple(sorted(key for _, key in loaded.values()))
        self._synced = wanted if {name: path for name, (path, _) in loaded.items()} == wanted_paths else None

    def _loaded(self) -> dict[str, tuple[str, str]]:
        """Name -> (path, NAME@DIGEST) of what the engine holds (on the engine thread)."""
        return {name: (str(a.path), a.key) for name, a in self.engine.adapters.loaded.items()}

    async def _on_engine(self, fn):
        return await asyncio.wait_for(asyncio.wrap_future(self.engine_loop.call(fn)), ENGINE_CALL_S)
