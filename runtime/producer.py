"""The one way requests and cancels reach the workers: XADD onto the model's request stream, and
PUBLISH on its cancel channel. Used by the gateway and by queue producers (``runtime/client.py``).

A bounded enqueue (``QueueLimit``) counts what the model's streams hold (queued and running: an
entry is deleted when its request ends) and adds the requests in the same Lua script, so a burst
of requests checked at once cannot all pass a limit that only one more would fit (the check, then
the add, let a burst of 480 through a limit of 40)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import zip_longest
from typing import Sequence

import redis.asyncio as aioredis

from pagedserve.runtime.redis_client import pipelines_publish
from pagedserve.runtime.redis_io import as_text
from pagedserve.shared.keys import Keys
from pagedserve.shared.protocol import WireCancel, WireRequest


BOUNDED_ADD = """
local depth = 0
for i = 1, tonumber(ARGV[2]) do depth = depth + redis.call('XLEN', KEYS[i]) end
local count = (#ARGV - 2) / 2
if depth + count > tonumber(ARGV[1]) then return {0, depth} end
local ids = {}
for j = 0, count - 1 do
  ids[#ids + 1] = redis.call('XADD', KEYS[tonumber(ARGV[3 + 2 * j])], '*', 'data', ARGV[4 + 2 * j])
end
return ids
"""  # KEYS: the streams counted; ARGV: the limit, how many keys are counted, then (key index, payload) per request


@dataclass(frozen=True)
class QueueLimit:
    """At most ``depth`` entries in all of ``counted`` (the model's shared stream and its workers'
    own streams) once the requests are added."""
    depth: int
    counted: tuple[str, ...]


class QueueFull(Exception):
    """The requests would take the model's streams past their ``QueueLimit``; nothing was added."""

    def __init__(self, depth: int, limit: int) -> None:
        super().__init__(f"{depth} requests are queued or running (limit {limit})")
        self.depth, self.limit = depth, limit


class Producer:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def enqueue(self, requests: Sequence[WireRequest], streams: Sequence[str | None] = (),
                      limit: QueueLimit | None = None) -> list[str]:
        """Push each request onto its model's stream (or the stream ``streams`` names for it: a
        worker's own, when the gateway routed it there), in one round trip; their entry ids.
        With ``limit``: all of them or none (``QueueFull``), decided in the same step as the add."""
        targets = [stream or self.keys.requests(request.model) for request, stream in zip_longest(requests, streams)]
        if limit is not None:
            return await self._bounded(requests, targets, limit)
        pipe = self.redis.pipeline(transaction=False)
        for request, target in zip(requests, targets):
            pipe.xadd(target, {"data": request.encode()})
        return [as_text(e) for e in await pipe.execute()]

    async def _bounded(self, requests: Sequence[WireRequest], targets: list[str], limit: QueueLimit) -> list[str]:
        keys = list(dict.fromkeys([*limit.counted, *targets]))  # a target not counted yet is counted too
        args: list = [limit.depth, len(keys)]
        for request, target in zip(requests, targets):
            args += [keys.index(target) + 1, request.encode()]
        reply = await self.redis.eval(BOUNDED_ADD, len(keys), *keys, *args)
        if reply and isinstance(reply[0], int):
            raise QueueFull(int(reply[1]), limit.depth)
        return [as_text(e) for e in reply]

    async def cancel(self, model: str, request_ids: Sequence[str], reason: str) -> None:
        """Ask the model's workers to abort these requests (a worker not holding one ignores it)."""
        if not request_ids:
            return
        messages = [WireCancel(request_id, reason).encode() for request_id in request_ids]
        if not pipelines_publish(self.redis):  # a cluster client keeps PUBLISH out of pipelines
            for message in messages:
                await self.redis.publish(self.keys.cancel(model), message)
            return
        pipe = self.redis.pipeline(transaction=False)
        for message in messages:
            pipe.publish(self.keys.cancel(model), message)
        await pipe.execute()
