"""One way to open Redis for every process: a single server (``redis://``, ``rediss://``,
``unix://``) or a Redis Cluster (``redis+cluster://host:port``, ``rediss+cluster://``: any node;
the client discovers the rest and follows the slots).

Every key of one model shares a hash tag (``shared/keys.py``), so all of a model's multi-key
commands address one slot; pub/sub goes through the cluster bus to every node.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster(url: str) -> bool:
    return url.split("://", 1)[0] in CLUSTER_SCHEMES


def connect(url: str, blocking_pool: bool = False, **options) -> aioredis.Redis:
    """A client for ``url``; ``options`` go to the single-server client's pool (a cluster client
    keeps its own per-node pools and retries). ``blocking_pool``: a burst waits for a free
    connection (``max_connections``, ``timeout``) instead of failing."""
    scheme, _, rest = url.partition("://")
    if scheme in CLUSTER_SCHEMES:
        return RedisCluster.from_url(f"{CLUSTER_SCHEMES[scheme]}://{rest}")
    if blocking_pool:
        return aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(url, **options))
    return aioredis.from_url(url, **options)


def pipelines_publish(client) -> bool:
    """Whether PUBLISH may go in a pipeline: not on a cluster client (redis-py refuses it there)."""
    return not isinstance(client, RedisCluster)
