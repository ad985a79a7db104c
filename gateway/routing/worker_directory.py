"""The live workers, as their ``WorkerInfo`` keys say (written with each heartbeat, gone when a
worker stops beating): the one place the gateway learns what is served, by whom and how. The
router scores them, admission needs one, prompts must fit the smallest context and use token ids
all of them accept, ``/v1/models`` lists their models.

A model's list is read again once it is ``ttl_s`` old; an empty one is read again every time (a
worker that just came up is seen at once). A key that cannot be decoded is skipped and logged once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
import structlog

from pagedserve.shared.keys import Keys
from pagedserve.shared.protocol import ProtocolError
from pagedserve.shared.worker_info import WorkerInfo, adapter_name

log = structlog.get_logger("pagedserve.gateway")
TTL_S = 0.5


@dataclass(frozen=True)
class Workers:
    """One read of a model's live workers."""
    infos: tuple[WorkerInfo, ...]
    read_at: float

    @property
    def context_limit(self) -> int | None:
        return min((w.max_model_len for w in self.infos), default=None)

    @property
    def kv_cache_dtypes(self) -> list[str]:
        return sorted({w.kv_cache_dtype for w in self.infos})

    @property
    def adapters(self) -> list[str]:
        """The LoRA adapters some live worker holds, by name."""
        return sorted({adapter_name(key) for w in self.infos for key in w.adapters})

    def everyone_holds(self, name: str) -> bool:
        """Whether every live worker holds adapter ``name`` (any bytes): the shared stream may take its requests."""
        return all(w.holds_adapter(name) for w in self.infos)

    def adapter_key(self, name: str) -> str | None:
        """Adapter ``name``'s NAME@DIGEST (its prefix-cache salt) where every worker holding it holds
        the same bytes; None otherwise (a reload half done: no prefix routing for it meanwhile)."""
        keys = {key for w in self.infos for key in w.adapters if adapter_name(key) == name}
        return keys.pop() if len(keys) == 1 else None

    @property
    def vocab_size(self) -> int | None:
        return min((w.vocab_size for w in self.infos), default=None)


@dataclass
class WorkerDirectory:
    redis: aioredis.Redis
    keys: Keys
    ttl_s: float = TTL_S
    _read: dict[str, Workers] = field(default_factory=dict)
    _bad: set[bytes] = field(default_factory=set)  # keys already logged as unreadable

    async def workers(self, model: str) -> Workers:
        known = self._read.get(model)
        now = time.monotonic()
        if known is None or not known.infos or now - known.read_at >= self.ttl_s:
            known = self._read[model] = Workers(tuple(await self._scan(model)), now)
        return known

    async def models(self) -> list[str]:
        """Every model some live worker serves (read now: ``/v1/models`` is rare)."""
        return sorted({info.model for info in await self._scan("*")})

    async def _scan(self, model: str) -> list[WorkerInfo]:
        keys = [k async for k in self.redis.scan_iter(match=self.keys.worker_info_pattern(model), count=100)]
        infos = []
        for key, raw in zip(keys, await self._values(keys)):
            if raw is None:
                continue  # expired between the scan and the read
            try:
                infos.append(WorkerInfo.decode(raw))
            except ProtocolError as err:
                if key not in self._bad and len(self._bad) < 1000:
                    self._bad.add(key)
                    log.warning("unreadable worker info skipped", key=key.decode(errors="replace"), error=str(err))
        return infos

    async def _values(self, keys: list[bytes]) -> list[bytes | None]:
        # One GET each, pipelined: keys of different models live in different cluster slots.
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        return await pipe.execute() if keys else []
