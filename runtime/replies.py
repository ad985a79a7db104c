"""One pub/sub reader per process fans reply events out to per-request mailboxes
(``runtime/mailbox.py``), and a watch keeps requests from waiting on entries Redis lost.

Subscribe before enqueue: ``open(request)`` then ``send(boxes)``, which waits for the subscription
before pushing, so no early event is missed. Every request is kept until its terminal event. Once a
second the watch looks up the stream entry of each request that has heard nothing for ``quiet_s``:
an entry gone on two looks in a row (Redis restarted empty, or lost the last second of an
append-only file; the stream or group was deleted) and no terminal event means nobody will answer,
so the mailbox sends the request again (``Mailbox`` decides how: from the prompt, or resumed).

Redis unreachable (the subscription lost and not back) for longer than the outage grace
(``runtime/outage.py``): every open mailbox fails with ``RedisGone`` at once, so nobody waits for
a deadline on a Redis that is not coming back; ``end_all`` does the same when the gateway stops
while Redis is away.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from itertools import zip_longest

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ConnectionError as RedisConnectionError

from pagedserve.runtime.mailbox import Mailbox, failure
from pagedserve.runtime.outage import Outage
from pagedserve.runtime.producer import Producer, QueueLimit
from pagedserve.runtime.redis_io import REDIS_DOWN, listen_forever, stop_tasks
from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.protocol import WireRequest, decode_events

log = structlog.get_logger("pagedserve.dispatch")
VANISHED = "the request's queue entry vanished (did Redis restart without persistence?)"


class ReplyDispatcher:
    def __init__(self, client: aioredis.Redis, channel: str, producer: Producer,
                 watch_every_s: float = 1.0, quiet_s: float = 2.0, outage: Outage | None = None) -> None:
        self.client = client
        self.channel = channel
        self.producer = producer
        self.watch_every_s = watch_every_s
        self.quiet_s = quiet_s
        self.outage = outage or Outage()  # how long the subscription has been lost
        self._draining = False  # the process is stopping: with Redis away, nothing held is waited for
        self.cut_at_stop = 0  # requests ended so while stopping (the gateway's exit code says so)
        self._boxes: dict[str, Mailbox] = {}
        self._tasks: list[asyncio.Task] = []
        self._subscribed = asyncio.Event()
        self._stop = asyncio.Event()

    async def start(self, wait: bool = True) -> None:
        """Start reading; with ``wait``, return once subscribed (a service starts without waiting,
        so it can answer "Redis unavailable" instead of not answering at all)."""
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]
        if wait:
            await self._subscribed.wait()

    async def ready(self, timeout: float) -> None:
        """Return once the channel is subscribed; ``RedisConnectionError`` if it is not within ``timeout``:
        a request sent before the subscription holds could lose its first events."""
        try:
            await asyncio.wait_for(self._subscribed.wait(), timeout)
        except asyncio.TimeoutError:
            raise RedisConnectionError(f"not subscribed to {self.channel} (Redis unreachable?)") from None

    async def stop(self) -> None:
        await stop_tasks(self._tasks, self._stop)
        self._tasks = []

    def open(self, request: WireRequest | str) -> Mailbox:
        """A mailbox for a request about to be sent (kept, to send again), or for a bare id (read only)."""
        if isinstance(request, str):
            box = Mailbox(request)
        else:
            box = Mailbox(request.id, request=request, resend=self._push)
        self._boxes[box.request_id] = box
        return box

    async def send(self, boxes: list[Mailbox], streams: list[str | None] = (), subscribe_timeout: float = 5.0,
                   limit: QueueLimit | None = None) -> None:
        """Push the requests of ``boxes`` (one round trip) once the channel is subscribed; onto
        ``streams`` where given (routed), else the model's stream; within ``limit`` (else
        ``QueueFull``, nothing sent)."""
        await self.ready(subscribe_timeout)
        entry_ids = await self.producer.enqueue([box.request for box in boxes], streams, limit)
        for box, entry_id, stream in zip_longest(boxes, entry_ids, streams):
            box.entry_id, box.heard_at, box.stream = entry_id, time.monotonic(), stream

    async def _push(self, request: WireRequest, old_id: str) -> str:
        """A new attempt of a request: its mailbox answers to the new id, the old attempt is cancelled."""
        box = self._boxes.pop(old_id, None)
        if box is not None:
            self._boxes[request.id] = box
        await self.ready(5.0)
        await self.producer.cancel(request.model, [old_id], "sent again")
        return (await self.producer.enqueue([request]))[0]

    def wire_id(self, request_id: str) -> str:
        """The id the current attempt of ``request_id`` has on the wire (itself until it is sent again)."""
        return next((b.wire_id for b in self._boxes.values() if b.request_id == request_id), request_id)

    def close(self, box: Mailbox) -> None:
        self._boxes.pop(box.wire_id, None)

    @property
    def open_count(self) -> int:
        """Mailboxes open now: requests someone still waits on (none once everything ended)."""
        return len(self._boxes)

    async def _read(self) -> None:
        await listen_forever(self.client, self.channel, self._deliver, self._on_subscribed, self._on_lost, self._stop)

    def _on_subscribed(self) -> None:
        self._subscribed.set()
        self.outage.reached()

    def _on_lost(self) -> None:
        self._subscribed.clear()
        self.outage.failed()

    def drain(self) -> None:
        """The process is stopping: from now on, while Redis is unreachable, every request held ends
        at once (``RedisGone``) instead of after the outage grace."""
        self._draining = True
        self._end_if_gone()

    def _end_if_gone(self) -> bool:
        """End every open mailbox if Redis is gone past the grace (or away at all while draining)."""
        if not (self.outage.past_grace() or (self._draining and self.outage.down)):
            return False
        ended = self.end_all(self.outage.gone())
        self.cut_at_stop += ended if self._draining else 0
        if ended:
            log.error("Redis unreachable: requests held here end with an error", requests=ended,
                      down_s=round(self.outage.down_s, 1), grace_s=self.outage.grace_s, stopping=self._draining)
        return True

    def end_all(self, error: Exception) -> int:
        """Fail every open mailbox with ``error`` (``Mailbox.fail``); how many were open."""
        boxes = [box for box in self._boxes.values() if not box.done and not box.failed]
        for box in boxes:
            box.fail(error)
        return len(boxes)

    def _deliver(self, data: bytes) -> None:
        try:
            events = decode_events(data)
        except (InvalidRequestError, KeyError, TypeError) as err:
            log.warning("undecodable reply batch", error=str(err))
            return
        for event in events:
            box = self._boxes.get(event.id)
            if box is not None:
                box.put(event)

    async def _watch(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):  # stopping returns at once, not after a grace
                await asyncio.wait_for(self._stop.wait(), self.watch_every_s)
                return
            if self._end_if_gone():
                continue
            try:
                await self.check_entries()
            except REDIS_DOWN:
                pass  # looked at again once Redis answers
            except Exception:  # a key of another type under the stream's name, say: keep watching
                log.exception("checking queue entries failed")

    async def check_entries(self) -> None:
        """Look up the entry of every request quiet for ``quiet_s``; one gone twice is sent again."""
        now = time.monotonic()
        quiet = [b for b in self._boxes.values()
                 if not b.done and b.entry_id and b.request is not None and now - b.heard_at >= self.quiet_s]
        if not quiet:
            return
        pipe = self.client.pipeline(transaction=False)
        for box in quiet:
            pipe.xrange(box.stream or self.producer.keys.requests(box.request.model), box.entry_id, box.entry_id)
        for box, found in zip(quiet, await pipe.execute()):
            box.missing_checks = 0 if found else box.missing_checks + 1
            if box.missing_checks >= 2:
                log.warning("queue entry vanished; sending the request again", request_id=box.request_id,
                            entry_id=box.entry_id)
                box.missing_checks = 0
                box.put(failure(box.wire_id, VANISHED, resumable=True))
