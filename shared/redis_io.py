"""Redis helpers shared by the services: what counts as "Redis is down", and a pub/sub subscription
that survives a lost connection."""

from __future__ import annotations

import asyncio
from typing import Callable

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = structlog.get_logger("pagedserve.redis")
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


async def listen_forever(
    client: aioredis.Redis, channel: str, on_message: Callable[[bytes], None],
    on_subscribed: Callable[[], None] | None = None, on_lost: Callable[[], None] | None = None,
) -> None:
    """Call ``on_message`` for every message on ``channel``, resubscribing after a lost connection
    (messages published meanwhile are gone: pub/sub keeps nothing). Runs until cancelled.
    ``on_subscribed`` / ``on_lost`` tell when the subscription holds and when it broke. Retries back
    off from 0.2 s to 5 s, so an outage costs a few log lines, not one every 0.2 s."""
    delay = 0.2
    while True:
        try:
            async with client.pubsub() as pubsub:
                await pubsub.subscribe(channel)
                async for msg in pubsub.listen():
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
