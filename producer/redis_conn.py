"""One Redis or a Redis Cluster, from one URL: `redis://host:port/0` is a single server,
`redis+cluster://host:port` (or `rediss+cluster://`) a cluster reached through any of its
nodes. Producer, worker and API open their connections here, so the same code runs on both.

On a cluster, redis-py's RedisCluster routes each command and script by its keys' slot
(genq's names keep what one call touches in one slot: `Keys`), MULTI is not available (a
pipeline runs its commands in order on each node instead), and plain PUBLISH/SUBSCRIBE is
relayed by every node of the cluster to every other: a subscriber on any node hears every
channel. The asyncio RedisCluster has no pub/sub, so asyncio subscribers use a plain
connection to one node (`NodePubSub`). Jobs' events on a Redis 7 cluster are shard channels
instead, read on their slot's node (`producer.shard_pubsub`).
"""

from __future__ import annotations

import random
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster

CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


# Redis away, for now: what a reader or writer waits out and tries again, as an outage.
# (BusyLoadingError, a restarting Redis's, is a ConnectionError.) A Redis Cluster that lost a
# master answers CLUSTERDOWN on every node, reads included, until a replica takes over; redis-py
# tries a command again a few times within a second, then raises it.
REDIS_AWAY = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError)


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
        return _keeping_nodes(redis.cluster.RedisCluster.from_url(plain_url(url), **kwargs))
    return redis.Redis.from_url(url, **kwargs)


def connect_async(url: str, **kwargs: Any) -> Any:
    """An asyncio client (redis.asyncio.Redis), a RedisCluster for a cluster URL."""
    if is_cluster_url(url):
        return _keeping_nodes(redis.asyncio.cluster.RedisCluster.from_url(plain_url(url), **kwargs))
    return redis.asyncio.Redis.from_url(url, **kwargs)


class _AskingEveryNode(redis.cluster.NodesManager):
    """redis-py's slot map (blocking), asking every node of the last map too when it learns the
    slots again. redis-py drops a node from the ones it asks when a command to it fails, and
    closes every connection to learn again; calls under way on other nodes then fail too and
    drop theirs, so a master lost while several tasks use the client (a worker) could leave it
    none to ask: "Redis Cluster cannot be connected ... None", for good."""

    def initialize(self) -> None:
        for name, node in self.nodes_cache.items():
            self.startup_nodes.setdefault(name, node)
        super().initialize()


class _AskingEveryNodeAsync(redis.asyncio.cluster.NodesManager):
    """The asyncio one (see _AskingEveryNode)."""

    __slots__ = ()

    async def initialize(self) -> None:
        for name, node in self.nodes_cache.items():
            self.startup_nodes.setdefault(name, node)
        await super().initialize()


def _keeping_nodes(cluster: Any) -> Any:
    """`cluster` with a slot map that asks every node it knows (_AskingEveryNode)."""
    async_client = isinstance(cluster, redis.asyncio.cluster.RedisCluster)
    cluster.nodes_manager.__class__ = _AskingEveryNodeAsync if async_client else _AskingEveryNode
    return cluster


def connect_async_pubsub(url: str, cluster: Any = None, **kwargs: Any) -> Any:
    """What to SUBSCRIBE and PUBLISH on (asyncio): `cluster` itself off a cluster; on one,
    a `NodePubSub` over the cluster client `cluster`."""
    return NodePubSub(url, cluster, **kwargs) if is_cluster_url(url) else cluster


class NodePubSub:
    """Pub/sub on a Redis Cluster for asyncio code, standing in for a redis.asyncio.Redis of
    which only `pubsub()` and `publish()` are used. Each `pubsub()` is made on a random node
    the cluster client knows (every node relays every PUBLISH; before the client has met the
    cluster, on the URL's node), so a listener that subscribes again after its node was lost
    (a failover) goes elsewhere rather than back to the node that is gone."""

    def __init__(self, url: str, cluster: Any, **kwargs: Any) -> None:
        self.url = url
        self.cluster = cluster
        self.kwargs = kwargs
        self._clients: dict[tuple[str, int], redis.asyncio.Redis] = {}

    def _client(self) -> redis.asyncio.Redis:
        nodes = self.cluster.get_nodes() if self.cluster is not None else []
        if nodes:
            node = random.choice(nodes)
            where, url = (node.host, int(node.port)), node_url(self.url, node.host, int(node.port))
        else:
            parts = urlsplit(plain_url(self.url))
            where, url = (parts.hostname or "", int(parts.port or 6379)), plain_url(self.url)
        if where not in self._clients:
            self._clients[where] = redis.asyncio.Redis.from_url(url, **self.kwargs)
        return self._clients[where]

    def pubsub(self, **kwargs: Any) -> Any:
        return self._client().pubsub(**kwargs)

    async def publish(self, channel: str, message: str) -> int:
        return int(await self._client().publish(channel, message))

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()


def node_url(url: str, host: str, port: int) -> str:
    """`url` (a cluster's) made the plain URL of node host:port, its credentials kept."""
    parts = urlsplit(plain_url(url))
    auth = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=f"{auth}@{host}:{port}" if auth else f"{host}:{port}"))


def is_cluster(conn: Any) -> bool:
    """Whether `conn` is a RedisCluster client (blocking or asyncio)."""
    return isinstance(conn, redis.cluster.RedisCluster | redis.asyncio.cluster.RedisCluster)


def pipeline(conn: Any, transaction: bool = True) -> Any:
    """`conn.pipeline(transaction)`, without MULTI on a cluster (redis-py has none there): each
    node runs its share of the commands in order, and only what one script does is atomic."""
    return conn.pipeline(transaction=transaction and not is_cluster(conn))


def ordered_writes(conn: Any) -> Any:
    """Writes that go together, queued like a pipeline's and sent with `await .execute()`
    (asyncio clients): one MULTI on a single Redis. A Redis Cluster has no transaction across
    slots (nor does redis-py's cluster pipeline), and its pipeline writes to each node at once,
    in no order between nodes; there the commands run one after another in the order queued,
    each answered before the next is sent. A reader or a crash then sees a prefix of them, so a
    caller queues last the write that makes the rest visible (an index, a set of active ids)."""
    return _OneByOne(conn) if is_cluster(conn) else conn.pipeline(transaction=True)


class _OneByOne:
    """ordered_writes on a cluster: the commands queued, then awaited in turn."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._queued: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        command = getattr(self._conn, name)

        def queue(*args: Any, **kwargs: Any) -> _OneByOne:
            self._queued.append((command, args, kwargs))
            return self

        return queue

    async def execute(self) -> list[Any]:
        queued, self._queued = self._queued, []
        return [await command(*args, **kwargs) for command, args, kwargs in queued]


def mget(conn: Any, keys: list[str]) -> Any:
    """`conn.mget(keys)` (awaitable for an asyncio client); on a cluster, whose MGET takes
    keys of one slot only, redis-py's mget_nonatomic: one MGET per slot, the replies in order."""
    return conn.mget_nonatomic(keys) if is_cluster(conn) else conn.mget(keys)


async def xreadgroup(conn: Any, group: str, consumer: str, streams: dict[str, str], count: int | None = None,
                     block_ms: int | None = None) -> Any:
    """`conn.xreadgroup` (asyncio). On a cluster it goes straight to the node of the streams'
    slot (they share one): redis-py's cluster client would first ask a node which of its
    arguments are keys (COMMAND GETKEYS: XREADGROUP's keys move), one more round trip per read,
    all of them to one node."""
    if not isinstance(conn, redis.asyncio.cluster.RedisCluster):
        return await conn.xreadgroup(group, consumer, streams, count=count, block=block_ms)  # type: ignore[arg-type]
    pieces: list[Any] = ["GROUP", group, consumer]
    if count is not None:
        pieces += ["COUNT", count]
    if block_ms is not None:
        pieces += ["BLOCK", block_ms]
    pieces += ["STREAMS", *streams, *streams.values()]
    # redis-py retries a command it routed itself where the cluster changed under it (a node
    # lost, a failover: ClusterDownError, ConnectionError...), learning the slots again; one
    # given its node it does not retry, so this does, as often, asking for the node anew
    retries = conn.cluster_error_retry_attempts
    for attempt in range(retries + 1):
        try:
            await conn.initialize()  # (a no-op while it knows the slots)
            node = conn.get_node_from_key(next(iter(streams)))
            return await conn.execute_command("XREADGROUP", *pieces, target_nodes=node)
        except conn.ERRORS_ALLOW_RETRY:
            if attempt == retries:
                raise
    raise AssertionError("unreachable")
