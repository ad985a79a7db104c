"""The worker's Redis I/O: read and reclaim stream entries, publish event batches, acknowledge.

Typed helpers only; the decisions (what to read, when to give up on an entry) are the service's.

A worker reads two streams with one consumer group name: its own (``Keys.routed``: requests the
gateway routed to it for its cached prefixes), first, then the model's shared stream. Entry ids
from its own stream carry the prefix ``r:`` so the rest of the worker handles ids alike; every
acknowledgement goes to the stream the id names. A dead worker's own stream is moved onto the
shared stream by whichever worker notices (``adopt_dead_routed``), entries it had been handed
marked with their delivery count, so they are treated as reclaimed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from pagedserve.runtime.redis_client import pipelines_publish
from pagedserve.runtime.redis_io import as_text
from pagedserve.shared.keys import Keys
from pagedserve.shared.protocol import ReplyTarget, WireEvent, encode_events
from pagedserve.worker.serve.bridge_scripts import KEEP_HELD, MOVE_ROUTED, TAKE_NAME

STREAMED_TTL_S = 24 * 3600

OWN = "r:"  # prefix of entry ids from the worker's own stream


class ConsumerNameTaken(RuntimeError):
    pass


@dataclass(frozen=True)
class Entry:
    entry_id: str
    data: bytes | None  # None when the entry was deleted before it was read
    deliveries: int = 1  # > 1: delivered before (reclaimed, or moved from a dead worker's own stream)


@dataclass(frozen=True)
class Outgoing:
    """One event for one reply target; ``entry_id``: the entry its request holds (None: none, a
    dead-lettered one's), acknowledged once the terminal event is sent, and after Redis was away
    checked to be still held before anything is sent for it."""

    target: ReplyTarget
    event: WireEvent
    entry_id: str | None = None


class RedisBridge:
    def __init__(self, client: aioredis.Redis, keys: Keys, model: str, consumer: str) -> None:
        self.r = client
        self.keys = keys
        self.stream = keys.requests(model)
        self.own = keys.routed(model, consumer)
        self.group = keys.group(model)
        self.model = model
        self.consumer = consumer
        self.token = uuid.uuid4().hex  # tells this process's liveness key from another's with the same name

    async def ensure_group(self) -> None:
        for stream in (self.stream, self.own):
            try:
                await self.r.xgroup_create(stream, self.group, id="0", mkstream=True)
            except ResponseError as err:
                if "BUSYGROUP" not in str(err):
                    raise

    def _stream_of(self, entry_id: str) -> tuple[str, str]:
        """(stream, Redis id) of an entry id as this worker hands it around."""
        return (self.own, entry_id[len(OWN):]) if entry_id.startswith(OWN) else (self.stream, entry_id)

    def _handed_id(self, stream: str, eid) -> str:
        """The entry id this worker hands around for Redis id ``eid`` of ``stream`` (``_stream_of`` reversed)."""
        return (OWN if stream == self.own else "") + as_text(eid)

    def _by_stream(self, entry_ids: list[str]) -> dict[str, list[str]]:
        grouped: dict[str, list[str]] = {}
        for entry_id in entry_ids:
            stream, eid = self._stream_of(entry_id)
            grouped.setdefault(stream, []).append(eid)
        return grouped

    def _queue_acks(self, pipe, entry_ids: list[str]) -> None:
        """XACK and XDEL of these entries, each on its own stream, added to ``pipe``."""
        for stream, ids in self._by_stream(entry_ids).items():
            pipe.xack(stream, self.group, *ids)
            pipe.xdel(stream, *ids)

    async def wait_for_name(self, ttl_s: float, patience_s: float, info: bytes) -> None:
        """Take the consumer name and publish ``info`` (an encoded WorkerInfo) with it, waiting up to
        ``patience_s`` for another holder's key to expire."""
        keys = (self.keys.alive(self.model, self.consumer), self.keys.worker_info(self.model, self.consumer))
        deadline = time.monotonic() + patience_s
        while not await self.r.eval(TAKE_NAME, 2, *keys, self.token, int(ttl_s * 1000), info):
            if time.monotonic() > deadline:
                raise ConsumerNameTaken(f"another live worker uses the consumer name {self.consumer!r}; "
                                        "give this one a different --consumer")
            await asyncio.sleep(0.25)

    async def read(self, count: int, block_ms: int | None, own_pending: bool = False) -> list[Entry]:
        """New entries (``>``), or with ``own_pending`` the ones this consumer holds unacknowledged;
        its own stream's first, then the shared stream's for the rest of ``count``. Nothing read is
        handed back: an entry added again gets a new id, and the gateway, not finding the one it
        sent, would send the request a second time. (Only when both streams fill during one
        blocking wait can a read bring up to ``count`` from each.)"""
        if own_pending:
            return self._entries(await self.r.xreadgroup(self.group, self.consumer, {self.own: "0", self.stream: "0"},
                                                         count=count))
        entries = self._entries(await self.r.xreadgroup(self.group, self.consumer, {self.own: ">"}, count=count))
        if len(entries) < count:
            # Wait only when nothing came: then on both streams, so a routed entry is not kept waiting.
            streams = {self.stream: ">"} if entries else {self.own: ">", self.stream: ">"}
            entries += self._entries(await self.r.xreadgroup(self.group, self.consumer, streams, count=count - len(entries),
                                                             block=None if entries else block_ms))
        return entries

    def _entries(self, reply) -> list[Entry]:
        """An XREADGROUP reply's entries, the own stream's first."""
        entries = [_entry(self._handed_id(as_text(stream), eid), fields) for stream, items in reply or [] for eid, fields in items]
        entries.sort(key=lambda e: not e.entry_id.startswith(OWN))
        return entries

    async def reclaim(self, min_idle_ms: int, count: int) -> list[Entry]:
        """Entries of dead consumers idle past ``min_idle_ms``, now ours, with their delivery counts."""
        reply = await self.r.xautoclaim(self.stream, self.group, self.consumer, min_idle_ms, "0-0", count=count)
        claimed, deleted = reply[1], (reply[2] if len(reply) > 2 else [])  # Redis 7 adds the deleted ids
        for eid in deleted:
            await self.ack([as_text(eid)])
        return [await self.with_deliveries(_entry(as_text(eid), fields)) for eid, fields in claimed]

    async def reclaim_from_dead(self, count: int) -> list[Entry]:
        """Entries held by consumers whose liveness key has expired (they stopped beating), now
        ours: a dead worker is noticed within three heartbeats, not after the idle limit."""
        summary = await self.r.xpending(self.stream, self.group)
        claimed: list[Entry] = []
        for holder in summary.get("consumers") or []:
            name = as_text(holder["name"])
            if name == self.consumer or count <= len(claimed) or await self.r.exists(self.keys.alive(self.model, name)):
                continue
            held = await self.r.xpending_range(self.stream, self.group, "-", "+", count - len(claimed), consumername=name)
            ids = [as_text(e["message_id"]) for e in held]
            if ids:
                for eid, fields in await self.r.xclaim(self.stream, self.group, self.consumer, 0, ids):
                    claimed.append(await self.with_deliveries(_entry(as_text(eid), fields)))
        return claimed

    async def adopt_dead_routed(self) -> int:
        """Move the own streams of workers that stopped beating onto the shared stream; how many
        entries moved (the gateway routes only to live workers, but one may die holding some)."""
        moved = 0
        async for key in self.r.scan_iter(match=self.keys.routed_pattern(self.model), count=100):
            name = as_text(key)[len(self.keys.routed(self.model, "")):]
            if name != self.consumer and not await self.r.exists(self.keys.alive(self.model, name)):
                moved += int(await self.r.eval(MOVE_ROUTED, 2, as_text(key), self.stream, self.group, "all"))
        return moved

    async def give_back_unread(self) -> int:
        """Move what was routed to this worker and never read onto the shared stream (draining)."""
        return int(await self.r.eval(MOVE_ROUTED, 2, self.own, self.stream, self.group, "unread"))

    async def with_deliveries(self, entry: Entry) -> Entry:
        stream, eid = self._stream_of(entry.entry_id)
        info = await self.r.xpending_range(stream, self.group, eid, eid, 1)
        return Entry(entry.entry_id, entry.data, max(entry.deliveries, info[0]["times_delivered"]) if info else entry.deliveries)

    async def heartbeat(self, entry_ids: list[str], ttl_s: float, metrics: dict, info: bytes) -> set[str]:
        """Reset the idle time of those in-flight entries this consumer still holds, renew the
        liveness key and the WorkerInfo (``info``, encoded); returns the ids still held (an entry
        Redis lost, or that another worker claimed, is not touched: taking it back would run it twice)."""
        pipe = self.r.pipeline(transaction=False)
        calls = self._keep_held(pipe, entry_ids, ttl_s)
        pipe.set(self.keys.worker_info(self.model, self.consumer), info, px=int(ttl_s * 1000))
        if metrics:
            pipe.hset(self.keys.metrics(self.model, self.consumer), mapping=metrics)
            pipe.pexpire(self.keys.metrics(self.model, self.consumer), int(ttl_s * 1000))
        return self._held(calls, await pipe.execute())

    async def confirm_held(self, entry_ids: list[str], ttl_s: float) -> set[str]:
        """Which of these entries this consumer still holds (their idle time reset, the liveness
        key renewed, in one round trip): what a worker asks before sending anything after Redis
        was away, since another worker may have taken them over meanwhile."""
        pipe = self.r.pipeline(transaction=False)
        calls = self._keep_held(pipe, entry_ids, ttl_s)
        return self._held(calls, await pipe.execute())

    def _keep_held(self, pipe, entry_ids: list[str], ttl_s: float) -> list[str]:
        """Add to ``pipe`` the KEEP_HELD scripts of these entries (500 ids a call) and the liveness
        key's renewal; the stream of each script call, in order."""
        calls = []
        for stream, ids in self._by_stream(entry_ids).items():
            for start in range(0, len(ids), 500):
                pipe.eval(KEEP_HELD, 1, stream, self.group, self.consumer, *ids[start : start + 500])
                calls.append(stream)
        pipe.set(self.keys.alive(self.model, self.consumer), self.token, px=int(ttl_s * 1000))
        return calls

    def _held(self, calls: list[str], results: list) -> set[str]:
        return {self._handed_id(stream, eid) for stream, kept in zip(calls, results) for eid in kept}

    async def publish(self, batch: list[Outgoing]) -> list[tuple[ReplyTarget, Exception]]:
        """One PUBLISH (or XADD) per reply target for the whole batch, in order; then the acks.

        A target Redis refuses (a key of the wrong type, say) fails its own requests only: it comes
        back in the result and the rest of the batch, acks included, goes through. A lost
        connection raises, and the caller sends the batch again. On one server it all goes in one
        pipeline; on a cluster, which keeps PUBLISH out of pipelines, the replies go one by one first."""
        by_target: OrderedDict[ReplyTarget, list[WireEvent]] = OrderedDict()
        for item in batch:
            by_target.setdefault(item.target, []).append(item.event)
        payloads = {target: encode_events(events) for target, events in by_target.items()}
        pipe = self.r.pipeline(transaction=False)
        together = pipelines_publish(self.r)
        sent = [] if together else [await self._send_one(target, payload) for target, payload in payloads.items()]
        if together:
            for target, payload in payloads.items():
                _send(pipe, target, payload)
        for item in batch:
            if item.event.seq == 0 and not item.event.done:
                pipe.set(self.keys.streamed(item.event.id), 1, ex=STREAMED_TTL_S)
            if item.entry_id is not None and item.event.done:
                self._queue_acks(pipe, [item.entry_id])
                pipe.delete(self.keys.streamed(item.event.id))
        results = await pipe.execute(raise_on_error=False)
        if together:
            sent, results = results[: len(payloads)], results[len(payloads):]
        failed = [(target, r) for target, r in zip(payloads, sent) if isinstance(r, Exception)]
        others = [r for r in results if isinstance(r, Exception)]
        if others:
            raise others[0]
        return failed

    async def _send_one(self, target: ReplyTarget, payload: bytes):
        """One reply on its own: Redis's answer, or the error it refused it with."""
        try:
            return await _send(self.r, target, payload)
        except ResponseError as err:
            return err

    async def ack(self, entry_ids: list[str]) -> None:
        if entry_ids:
            pipe = self.r.pipeline(transaction=False)
            self._queue_acks(pipe, entry_ids)
            await pipe.execute()

    async def hand_back(self, entries: list[Entry]) -> None:
        """Entries this worker read but will not serve (it is stopping) back onto the stream, as new
        entries another worker reads, in one transaction with their acknowledgement."""
        if entries:
            pipe = self.r.pipeline(transaction=True)
            for entry in entries:
                pipe.xadd(self.stream, {"data": entry.data or b""})
            self._queue_acks(pipe, [entry.entry_id for entry in entries])
            await pipe.execute()

    async def dead_letter(self, entry: Entry, reason: str) -> None:
        """Move an entry to the dead-letter stream with the reason, and acknowledge it."""
        await self.r.xadd(self.keys.dead_letter(self.model), {
            "data": entry.data or b"", "reason": reason, "entry_id": entry.entry_id,
            "consumer": self.consumer, "deliveries": entry.deliveries,
        })
        await self.ack([entry.entry_id])

    async def was_streamed(self, request_id: str) -> bool:
        return bool(await self.r.exists(self.keys.streamed(request_id)))

    async def leave(self) -> None:
        """Give what is left on this worker's own stream to the others, and stop beating."""
        await self.r.eval(MOVE_ROUTED, 2, self.own, self.stream, self.group, "all")
        await self.r.delete(self.keys.alive(self.model, self.consumer), self.keys.worker_info(self.model, self.consumer),
                            self.keys.metrics(self.model, self.consumer))

    async def publish_kv(self, event: bytes, max_len: int) -> None:
        """One KV event onto the model's stream, trimmed to about ``max_len`` entries."""
        await self.r.xadd(self.keys.kv_events(self.model), {"data": event}, maxlen=max_len, approximate=True)


def _send(client, target: ReplyTarget, payload: bytes):
    """PUBLISH or XADD one batch of events to ``target`` (on a client or a pipeline)."""
    if target.kind == "channel":
        return client.publish(target.name, payload)
    return client.xadd(target.name, {"data": payload})


def _entry(entry_id: str, fields) -> Entry:
    """An entry as read; one moved from a dead worker's own stream counts its earlier deliveries."""
    if not fields:
        return Entry(entry_id, None)
    moved = fields.get(b"deliveries")
    return Entry(entry_id, fields.get(b"data"), int(moved) + 1 if moved is not None else 1)

