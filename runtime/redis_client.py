"""One way to open Redis for every process: a single server (``redis://``, ``rediss://``,
``unix://``) or a Redis Cluster (``redis+cluster://host:port``, ``rediss+cluster://``: any node;
the client discovers the rest and follows the slots).

Every key of one model shares a hash tag (``shared/keys.py``), so all of a model's multi-key
commands address one slot; pub/sub goes through the cluster bus to every node.

Every command waits at most ``COMMAND_TIMEOUT_S`` for its answer (the longest blocking read here
is 1 s): a Redis cut off without a reset (a network partition drops packets, nothing closes the
connection) is then an error the callers retry, not a call that never returns, and an idle
subscription is checked with a PING every ``HEALTH_CHECK_S``.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
COMMAND_TIMEOUT_S = 10.0
HEALTH_CHECK_S = 10


def is_cluster(url: str) -> bool:
    return url.split("://", 1)[0] in CLUSTER_SCHEMES


def connect(url: str, blocking_pool: bool = False, **options) -> aioredis.Redis:
    """A client for ``url``; ``options`` go to the single-server client's pool (a cluster client
    keeps its own per-node pools and retries). ``blocking_pool``: a burst waits for a free
    connection (``max_connections``, ``timeout``) instead of failing."""
    scheme, _, rest = url.partition("://")
    timeouts = {"socket_timeout": COMMAND_TIMEOUT_S, "socket_connect_timeout": COMMAND_TIMEOUT_S}
    if scheme in CLUSTER_SCHEMES:
        return RedisCluster.from_url(f"{CLUSTER_SCHEMES[scheme]}://{rest}", **timeouts)
    options = {**timeouts, "health_check_interval": HEALTH_CHECK_S, **options}
    if blocking_pool:
        return aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(url, **options))
    return aioredis.from_url(url, **options)


def pipelines_publish(client) -> bool:
    """Whether PUBLISH may go in a pipeline: not on a cluster client (redis-py refuses it there)."""
    return not isinstance(client, RedisCluster)
