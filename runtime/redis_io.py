"""Redis helpers shared by the services: what counts as "Redis is down", and a pub/sub subscription
that survives a lost connection."""

from __future__ import annotations

import asyncio
from typing import Callable

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError

log = structlog.get_logger("pagedserve.redis")
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


def as_text(value) -> str:
    """A Redis reply's id or name as text (redis-py gives bytes unless told to decode)."""
    return value.decode() if isinstance(value, bytes) else str(value)


async def listen_forever(
    client: aioredis.Redis, channel: str, on_message: Callable[[bytes], None],
    on_subscribed: Callable[[], None] | None = None, on_lost: Callable[[], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Call ``on_message`` for every message on ``channel``, resubscribing after a lost connection
    (messages published meanwhile are gone: pub/sub keeps nothing). Runs until ``stop`` is set.
    ``on_subscribed`` / ``on_lost`` tell when the subscription holds and when it broke. Retries back
    off from 0.2 s to 5 s, so an outage costs a few log lines, not one every 0.2 s. Returns within a
    quarter of a second of ``stop`` being set: cancelling a task that waits in redis-py's read can be lost
    when it meets the read's own timeout (the retry layer then reads on), so owners stop it by flag."""
    delay = 0.2
    stopped = stop.is_set if stop is not None else (lambda: False)
    while not stopped():
        try:
            await client.initialize()  # a cluster client learns the slots here (its pub/sub needs them)
            async with client.pubsub() as pubsub:
                await pubsub.subscribe(channel)
                while not stopped():
                    msg = await pubsub.get_message(timeout=0.25)
                    if msg is None:
                        continue
                    if msg["type"] == "subscribe":
                        delay = 0.2
                        if on_subscribed is not None:
                            on_subscribed()
                    elif msg["type"] == "message":
                        on_message(msg["data"])
        except REDIS_DOWN as err:
            if on_lost is not None:
                on_lost()
            log.warning("subscription lost; resubscribing", channel=channel, error=str(err), retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


async def stop_tasks(tasks: list[asyncio.Task], stop: asyncio.Event, grace_s: float = 2.0) -> None:
    """Set ``stop``, give the tasks ``grace_s`` to return (their Redis reads time out often),
    then cancel what is left and wait for all of them."""
    stop.set()
    if tasks:
        await asyncio.wait(tasks, timeout=grace_s)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
