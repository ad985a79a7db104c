"""The one way requests and cancels reach the workers: XADD onto the model's request stream, and
PUBLISH on its cancel channel. Used by the gateway and by queue producers (``runtime/client.py``)."""

from __future__ import annotations

from itertools import zip_longest
from typing import Sequence

import redis.asyncio as aioredis

from pagedserve.runtime.redis_client import pipelines_publish
from pagedserve.shared.keys import Keys
from pagedserve.shared.protocol import WireCancel, WireRequest


class Producer:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def enqueue(self, requests: Sequence[WireRequest], streams: Sequence[str | None] = ()) -> list[str]:
        """Push each request onto its model's stream (or the stream ``streams`` names for it: a
        worker's own, when the gateway routed it there), in one round trip; their entry ids."""
        pipe = self.redis.pipeline(transaction=False)
        for request, stream in zip_longest(requests, streams):
            pipe.xadd(stream or self.keys.requests(request.model), {"data": request.encode()})
        return [e.decode() if isinstance(e, bytes) else str(e) for e in await pipe.execute()]

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
