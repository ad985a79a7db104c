"""The worker's Redis I/O: read and reclaim stream entries, publish event batches, acknowledge.

Typed helpers only; the decisions (what to read, when to give up on an entry) are the service's.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared.keys import Keys
from shared.protocol import ReplyTarget, WireEvent, encode_events

STREAMED_TTL_S = 24 * 3600

# Heartbeat for the given entries that this consumer still holds (atomic: no claim can slip in
# between the check and the reset); returns those ids.
KEEP_HELD = """
local mine = {}
for _, e in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', #ARGV + 100000, ARGV[2])) do
  mine[e[1]] = true
end
local keep, claim = {}, {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
for i = 3, #ARGV do
  if mine[ARGV[i]] then
    keep[#keep + 1] = ARGV[i]
    claim[#claim + 1] = ARGV[i]
  end
end
if #keep > 0 then
  claim[#claim + 1] = 'JUSTID'
  redis.call(unpack(claim))
end
return keep
"""


class ConsumerNameTaken(RuntimeError):
    pass


@dataclass(frozen=True)
class Entry:
    entry_id: str
    data: bytes | None  # None when the entry was deleted before it was read
    deliveries: int = 1


@dataclass(frozen=True)
class Outgoing:
    """One event for one reply target; ``entry_id`` is set on the terminal event (ack after send)."""

    target: ReplyTarget
    event: WireEvent
    entry_id: str | None = None


class RedisBridge:
    def __init__(self, client: aioredis.Redis, keys: Keys, model: str, consumer: str) -> None:
        self.r = client
        self.keys = keys
        self.stream = keys.requests(model)
        self.group = keys.group(model)
        self.model = model
        self.consumer = consumer
        self.token = uuid.uuid4().hex  # tells this process's liveness key from another's with the same name

    async def ensure_group(self) -> None:
        try:
            await self.r.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise

    async def wait_for_name(self, ttl_s: float, patience_s: float) -> None:
        """Take the consumer name, waiting up to ``patience_s`` for another holder's key to expire."""
        key = self.keys.alive(self.model, self.consumer)
        deadline = time.monotonic() + patience_s
        while not await self.r.set(key, self.token, px=int(ttl_s * 1000), nx=True):
            if await self.r.get(key) == self.token.encode():
                return
            if time.monotonic() > deadline:
                raise ConsumerNameTaken(f"another live worker uses the consumer name {self.consumer!r}; "
                                        "give this one a different --consumer")
            await asyncio.sleep(0.25)

    async def read(self, count: int, block_ms: int | None, own_pending: bool = False) -> list[Entry]:
        """New entries (``>``), or with ``own_pending`` the ones this consumer holds unacknowledged."""
        reply = await self.r.xreadgroup(
            self.group, self.consumer, {self.stream: "0" if own_pending else ">"}, count=count, block=block_ms
        )
        return [Entry(_text(eid), fields.get(b"data") if fields else None) for _, items in reply or [] for eid, fields in items]

    async def reclaim(self, min_idle_ms: int, count: int) -> list[Entry]:
        """Entries of dead consumers idle past ``min_idle_ms``, now ours, with their delivery counts."""
        reply = await self.r.xautoclaim(self.stream, self.group, self.consumer, min_idle_ms, "0-0", count=count)
        claimed, deleted = reply[1], (reply[2] if len(reply) > 2 else [])  # Redis 7 adds the deleted ids
        for eid in deleted:
            await self.ack([_text(eid)])
        return [await self.with_deliveries(Entry(_text(eid), fields.get(b"data") if fields else None))
                for eid, fields in claimed]

    async def reclaim_from_dead(self, count: int) -> list[Entry]:
        """Entries held by consumers whose liveness key has expired (they stopped beating), now
        ours: a dead worker is noticed within three heartbeats, not after the idle limit."""
        summary = await self.r.xpending(self.stream, self.group)
        claimed: list[Entry] = []
        for holder in summary.get("consumers") or []:
            name = _text(holder["name"])
            if name == self.consumer or count <= len(claimed) or await self.r.exists(self.keys.alive(self.model, name)):
                continue
            held = await self.r.xpending_range(self.stream, self.group, "-", "+", count - len(claimed), consumername=name)
            ids = [_text(e["message_id"]) for e in held]
            if ids:
                for eid, fields in await self.r.xclaim(self.stream, self.group, self.consumer, 0, ids):
                    claimed.append(await self.with_deliveries(Entry(_text(eid), fields.get(b"data") if fields else None)))
        return claimed

    async def with_deliveries(self, entry: Entry) -> Entry:
        info = await self.r.xpending_range(self.stream, self.group, entry.entry_id, entry.entry_id, 1)
        return Entry(entry.entry_id, entry.data, info[0]["times_delivered"] if info else entry.deliveries)

    async def heartbeat(self, entry_ids: list[str], ttl_s: float, metrics: dict) -> set[str]:
        """Reset the idle time of those in-flight entries this consumer still holds and renew the
        liveness key; returns the ids still held (an entry Redis lost, or that another worker
        claimed, is not touched: taking it back would run it twice)."""
        pipe = self.r.pipeline(transaction=False)
        for start in range(0, len(entry_ids), 500):
            pipe.eval(KEEP_HELD, 1, self.stream, self.group, self.consumer, *entry_ids[start : start + 500])
        pipe.set(self.keys.alive(self.model, self.consumer), self.token, px=int(ttl_s * 1000))
        if metrics:
            pipe.hset(self.keys.metrics(self.model, self.consumer), mapping=metrics)
            pipe.pexpire(self.keys.metrics(self.model, self.consumer), int(ttl_s * 1000))
        results = await pipe.execute()
        return {_text(eid) for kept in results[: -(-len(entry_ids) // 500)] for eid in kept}

    async def publish(self, batch: list[Outgoing]) -> list[tuple[ReplyTarget, Exception]]:
        """One PUBLISH (or XADD) per reply target for the whole batch, in order; then the acks.

        A target Redis refuses (a key of the wrong type, say) fails its own requests only: it comes
        back in the result and the rest of the batch, acks included, goes through. A lost
        connection raises, and the caller sends the batch again."""
        by_target: OrderedDict[ReplyTarget, list[WireEvent]] = OrderedDict()
        for item in batch:
            by_target.setdefault(item.target, []).append(item.event)
        pipe = self.r.pipeline(transaction=False)
        for target, events in by_target.items():
            payload = encode_events(events)
            if target.kind == "channel":
                pipe.publish(target.name, payload)
            else:
                pipe.xadd(target.name, {"data": payload})
        for item in batch:
            if item.event.seq == 0 and not item.event.done:
                pipe.set(self.keys.streamed(item.event.id), 1, ex=STREAMED_TTL_S)
            if item.entry_id is not None:
                pipe.xack(self.stream, self.group, item.entry_id)
                pipe.xdel(self.stream, item.entry_id)
                pipe.delete(self.keys.streamed(item.event.id))
        results = await pipe.execute(raise_on_error=False)
        failed = [(target, r) for target, r in zip(by_target, results) if isinstance(r, Exception)]
        others = [r for r in results[len(by_target):] if isinstance(r, Exception)]
        if others:
            raise others[0]
        return failed

    async def ack(self, entry_ids: list[str]) -> None:
        if entry_ids:
            pipe = self.r.pipeline(transaction=False)
            pipe.xack(self.stream, self.group, *entry_ids)
            pipe.xdel(self.stream, *entry_ids)
            await pipe.execute()

    async def hand_back(self, entries: list[Entry]) -> None:
        """Entries this worker read but will not serve (it is stopping) back onto the stream, as new
        entries another worker reads, in one transaction with their acknowledgement."""
        if entries:
            pipe = self.r.pipeline(transaction=True)
            for entry in entries:
                pipe.xadd(self.stream, {"data": entry.data or b""})
            ids = [entry.entry_id for entry in entries]
            pipe.xack(self.stream, self.group, *ids)
            pipe.xdel(self.stream, *ids)
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
        await self.r.delete(self.keys.alive(self.model, self.consumer), self.keys.metrics(self.model, self.consumer))


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

