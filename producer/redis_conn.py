"""One Redis or a Redis Cluster, from one URL: `redis://host:port/0` is a single server,
`redis+cluster://host:port` (or `rediss+cluster://`) a cluster reached through any of its
nodes. Producer, worker and API open their connections here, so the same code runs on both.

On a cluster, redis-py's RedisCluster routes each command and script by its keys' slot
(genq's names keep what one call touches in one slot: `Keys`), MULTI is not available (a
pipeline runs its commands in order on each node instead), and pub/sub is plain
PUBLISH/SUBSCRIBE, which every node of the cluster relays to every other: a subscriber on any
node hears every channel. The asyncio RedisCluster has no pub/sub, so subscribers use a plain
connection to the node the URL names.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster

CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


def is_cluster_url(url: str) -> bool:
    """Whether `url` names a Redis Cluster (`redis+cluster://host:port`)."""
    return url.startswith(CLUSTER_SCHEMES)


def plain_url(url: str) -> str:
    """The node's own URL (`redis://host:port`) for a cluster URL; other URLs as they are."""
    return url.replace("+cluster://", "://", 1) if is_cluster_url(url) else url


# The clients are typed Any, as redis-py's from_url gives them: its command stubs mix the
# blocking and asyncio return types, and genq's callers were written against from_url.


def connect(url: str, **kwargs: Any) -> Any:
    """A blocking client (redis.Redis), a RedisCluster for a cluster URL."""
    if is_cluster_url(url):
        return redis.cluster.RedisCluster.from_url(plain_url(url), **kwargs)
    return redis.Redis.from_url(url, **kwargs)


def connect_async(url: str, **kwargs: Any) -> Any:
    """An asyncio client (redis.asyncio.Redis), a RedisCluster for a cluster URL."""
    if is_cluster_url(url):
        return redis.asyncio.cluster.RedisCluster.from_url(plain_url(url), **kwargs)
    return redis.asyncio.Redis.from_url(url, **kwargs)


def connect_async_pubsub(url: str, **kwargs: Any) -> Any:
    """An asyncio client to SUBSCRIBE on: on a cluster a plain connection to the node the URL
    names (every node relays every PUBLISH)."""
    return redis.asyncio.Redis.from_url(plain_url(url), **kwargs)


def is_cluster(conn: Any) -> bool:
    """Whether `conn` is a RedisCluster client (blocking or asyncio)."""
    return isinstance(conn, redis.cluster.RedisCluster | redis.asyncio.cluster.RedisCluster)


def pipeline(conn: Any, transaction: bool = True) -> Any:
    """`conn.pipeline(transaction)`, without MULTI on a cluster (redis-py has none there): each
    node runs its share of the commands in order, and only what one script does is atomic."""
    return conn.pipeline(transaction=transaction and not is_cluster(conn))


def mget(conn: Any, keys: list[str]) -> Any:
    """`conn.mget(keys)` (awaitable for an asyncio client); on a cluster, whose MGET takes
    keys of one slot only, redis-py's mget_nonatomic: one MGET per slot, the replies in order."""
    return conn.mget_nonatomic(keys) if is_cluster(conn) else conn.mget(keys)
