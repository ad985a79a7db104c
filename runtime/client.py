"""A small async client for queue producers: push requests onto a model's stream, read the events.

    async with QueueClient("redis://127.0.0.1:6379/0") as client:
        async for event in await client.submit("demo", prompt="Hello", params=SamplingParams(max_tokens=8)):
            print(event.outputs)

Replies come on this client's own pub/sub channel (subscribed before anything is pushed), or, with
``durable=True``, on a result stream that survives a disconnect and can be re-read. On the channel
path a request whose worker dies mid-stream, or whose entry Redis lost, is sent again and goes on
(``runtime/mailbox.py``); durable requests end with the error instead. Redis unreachable for longer
than ``outage_grace_s`` (``runtime/outage.py``): the channel path's iterations raise ``RedisGone``.
Leaving the iteration early cancels the request.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator

from pagedserve.runtime.mailbox import Mailbox
from pagedserve.runtime.outage import DEFAULT_GRACE_S, Outage
from pagedserve.runtime.producer import Producer
from pagedserve.runtime.redis_client import connect
from pagedserve.runtime.redis_io import REDIS_DOWN
from pagedserve.runtime.replies import ReplyDispatcher
from pagedserve.shared.keys import Keys
from pagedserve.shared.protocol import ReplyTarget, WireEvent, WireRequest, decode_events
from pagedserve.shared.sampling import SamplingParams


class QueueClient:
    def __init__(self, redis_url: str, keys: Keys | None = None, client_id: str | None = None,
                 outage_grace_s: float = DEFAULT_GRACE_S) -> None:
        self.redis = connect(redis_url)
        self.keys = keys or Keys()
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:12]}"
        self.producer = Producer(self.redis, self.keys)
        self.dispatcher = ReplyDispatcher(self.redis, self.keys.replies(self.client_id), self.producer,
                                          outage=Outage(outage_grace_s))

    async def __aenter__(self) -> "QueueClient":
        await self.dispatcher.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.dispatcher.stop()
        await self.redis.aclose()

    async def submit(
        self, model: str, *, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
        messages: list[dict] | None = None, params: SamplingParams | None = None, request_id: str | None = None,
        timeout: float | None = None, priority: int = 0, tenant: str | None = None, durable: bool = False,
    ) -> AsyncIterator[WireEvent]:
        """Push one request; returns an async iterator over its events (the last has ``done``)."""
        request_id = request_id or uuid.uuid4().hex
        reply = ReplyTarget("stream", self.keys.results(self.client_id)) if durable else \
            ReplyTarget("channel", self.dispatcher.channel)
        now = time.time()
        request = WireRequest(
            id=request_id, model=model, params=params or SamplingParams(), reply=reply, prompt=prompt,
            prompt_token_ids=prompt_token_ids, messages=messages, created=now,
            deadline=now + timeout if timeout else None, priority=priority, tenant=tenant,
        )
        await self.dispatcher.start()
        if durable:
            await self.producer.enqueue([request])
            return self._read_results(model, request_id, reply.name)
        box = self.dispatcher.open(request)
        try:
            await self.dispatcher.send([box])
        except BaseException:
            self.dispatcher.close(box)
            raise
        return self._read_mailbox(model, request_id, box)

    async def cancel(self, model: str, request_id: str, reason: str = "cancelled") -> None:
        await self.producer.cancel(model, [self.dispatcher.wire_id(request_id)], reason)

    async def _read_mailbox(self, model: str, request_id: str, box: Mailbox) -> AsyncIterator[WireEvent]:
        try:
            async for event in box.events():
                yield event
        finally:
            self.dispatcher.close(box)
            if not box.done:
                await self.producer.cancel(model, [box.wire_id], "client gone")

    async def _read_results(self, model: str, request_id: str, stream: str) -> AsyncIterator[WireEvent]:
        """Durable replies: every event of this request from the result stream, resends dropped."""
        last_id, expected, done = "0-0", 0, False
        try:
            while not done:
                try:
                    reply = await self.redis.xread({stream: last_id}, block=1000)
                except REDIS_DOWN:
                    await asyncio.sleep(0.2)  # Redis restarting: read again from where we were
                    continue
                for _, items in reply or []:
                    for entry_id, fields in items:
                        last_id = entry_id
                        for event in decode_events(fields[b"data"]):
                            if event.id != request_id or (0 <= event.seq < expected):
                                continue
                            expected = event.seq + 1
                            done = event.done
                            yield event
        finally:
            if not done:
                await self.cancel(model, request_id, "client gone")

