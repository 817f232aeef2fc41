"""Sharded pub/sub on a Redis 7 cluster, behind the few PubSub calls genq's readers make.

On a Redis 7 cluster a job's events channel is a shard channel (`Keys.sharded_pubsub`): the
worker's step script SPUBLISHes on it, and only the nodes of the channel's slot carry the
message, where a PUBLISH goes to every node. A reader SSUBSCRIBEs on the node that serves the
slot. `ShardPubSub` (blocking) and `AsyncShardPubSub` (asyncio) hold one connection per node
that serves a channel they follow and answer `subscribe`, `unsubscribe` and `get_message` as
redis-py's PubSub does ("subscribe" and "message" dicts, channels as bytes), so the Python
clients and the API's relay read shard channels and plain ones the same way.

Neither reconnects by itself: a lost connection, a node that answers for a slot it no longer
serves (MOVED), or one that gives a channel up (its slot moved, a failover: the server then
sends SUNSUBSCRIBE) is raised from the next call as a ConnectionError. The reader then makes a
new one, which finds the slots' nodes anew, and reads what it missed from the job's stream, as
after an outage. redis-py's own PubSub would re-subscribe only plain channels after a reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import time
from collections.abc import Iterable
from typing import Any

import redis
import redis.asyncio
from redis.cluster import key_slot

from producer.aio import wait_within
from producer.redis_conn import connect_async_pubsub, node_url

Node = tuple[str, int]


class _Channels:
    """What both kinds share: which node each channel was subscribed on, and the replies
    made into redis-py's PubSub messages."""

    def __init__(self) -> None:
        self.node_of: dict[bytes, Node] = {}
        self.leaving_now: dict[bytes, int] = {}  # SUNSUBSCRIBEs sent, not yet answered

    @staticmethod
    def name(channel: str | bytes) -> bytes:
        return channel.encode() if isinstance(channel, str) else channel

    def by_slot(self, channels: Iterable[str | bytes], node_of: Any) -> list[tuple[Node, list[bytes]]]:
        """The channels grouped by slot (one SSUBSCRIBE takes channels of one slot), each with
        the node `node_of(channel)` names, recorded for the channel."""
        out: dict[int, tuple[Node, list[bytes]]] = {}
        for channel in channels:
            name = self.name(channel)
            node = node_of(name)
            where = (str(node.host), int(node.port))
            self.node_of[name] = where
            out.setdefault(key_slot(name), (where, []))[1].append(name)
        return list(out.values())

    def leaving(self, channels: Iterable[str | bytes]) -> list[tuple[Node, list[bytes]]]:
        """The channels no longer wanted, grouped by slot, each with the node it was
        subscribed on."""
        out: dict[int, tuple[Node, list[bytes]]] = {}
        for channel in channels:
            name = self.name(channel)
            where = self.node_of.pop(name, None)
            if where is not None:
                out.setdefault(key_slot(name), (where, []))[1].append(name)
                self.leaving_now[name] = self.leaving_now.get(name, 0) + 1
        return list(out.values())

    def message(self, reply: Any) -> dict[str, Any] | None:
        """A node's reply as redis-py's PubSub gives it; None for one that says nothing.
        A SUNSUBSCRIBE of a channel still wanted is the node giving it up: ConnectionError."""
        if not isinstance(reply, list) or len(reply) != 3:
            return None
        kind, channel, data = reply
        kind = kind.decode() if isinstance(kind, bytes) else str(kind)
        if kind == "smessage":
            return {"type": "message", "pattern": None, "channel": channel, "data": data}
        if kind == "ssubscribe":
            return {"type": "subscribe", "pattern": None, "channel": channel, "data": data}
        if kind == "sunsubscribe":
            if self.leaving_now.get(channel, 0) > 0:  # (ours: a channel subscribed again since stays)
                self.leaving_now[channel] -= 1
                if not self.leaving_now[channel]:
                    del self.leaving_now[channel]
                return {"type": "unsubscribe", "pattern": None, "channel": channel, "data": data}
            raise redis.ConnectionError(f"the node gave up shard channel {channel!r} (its slot moved)")
        return None


class ShardPubSub:
    """A blocking PubSub over shard channels: `subscribe`, `unsubscribe`, `get_message`,
    `close`, on the RedisCluster `cluster` reached by `url`."""

    def __init__(self, cluster: Any, url: str) -> None:
        self.cluster = cluster
        self.url = url
        self._channels = _Channels()
        self._conns: dict[Node, Any] = {}  # (redis.Connection)

    def subscribe(self, *channels: str | bytes) -> None:
        try:
            for where, names in self._channels.by_slot(channels, self.cluster.get_node_from_key):
                self._conn(where).send_command("SSUBSCRIBE", *names)
        except redis.ConnectionError:
            self._relearn()
            raise

    def unsubscribe(self, *channels: str | bytes) -> None:
        for where, names in self._channels.leaving(channels):
            if where in self._conns:
                self._conns[where].send_command("SUNSUBSCRIBE", *names)

    def get_message(self, timeout: float | None = 0.0) -> dict[str, Any] | None:
        """The next message, or None after `timeout` seconds (None: wait for one)."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            for conn in list(self._conns.values()):
                while self._can_read(conn):
                    if (message := self._read(conn)) is not None:
                        return message
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return None
            socks = [sock for conn in self._conns.values() if (sock := conn._sock) is not None]
            if not socks:
                if left is None:
                    raise redis.ConnectionError("no shard channel subscribed to wait on")
                time.sleep(left)
                return None
            select.select(socks, [], [], left)

    def _can_read(self, conn: Any) -> bool:
        try:
            return bool(conn.can_read(timeout=0))
        except redis.ConnectionError:
            self._relearn()
            raise

    def _read(self, conn: Any) -> dict[str, Any] | None:
        try:
            return self._channels.message(conn.read_response())
        except redis.ResponseError as exc:  # MOVED: the slot is served elsewhere now
            self._relearn()
            raise redis.ConnectionError(f"shard channel subscription refused: {exc}") from exc
        except redis.ConnectionError:
            self._relearn()
            raise

    def _conn(self, where: Node) -> Any:
        if where not in self._conns:
            pool = redis.ConnectionPool.from_url(node_url(self.url, *where))
            conn = pool.make_connection()
            conn.connect()
            self._conns[where] = conn
        return self._conns[where]

    def _relearn(self) -> None:
        """Have the cluster client read the slots' nodes again: the next ShardPubSub goes where
        they are now (a promoted replica), not back to a node that is gone."""
        with contextlib.suppress(redis.RedisError, OSError):
            self.cluster.nodes_manager.initialize()

    def close(self) -> None:
        for conn in self._conns.values():
            conn.disconnect()
        self._conns.clear()


class AsyncShardPubSub:
    """An asyncio PubSub over shard channels: `subscribe`, `unsubscribe`, `get_message`,
    `connect`, `connection.is_connected` and `aclose`, on the asyncio RedisCluster `cluster`
    reached by `url`. A task per node reads its connection into one queue."""

    def __init__(self, cluster: Any, url: str, **kwargs: Any) -> None:
        self.cluster = cluster
        self.url = url
        self.kwargs = kwargs
        self._channels = _Channels()
        self._conns: dict[Node, redis.asyncio.Connection] = {}
        self._readers: list[asyncio.Task[None]] = []
        self._replies: asyncio.Queue[Any] = asyncio.Queue()
        self._failed: BaseException | None = None
        self._started = False

    @property
    def connection(self) -> AsyncShardPubSub | None:
        """(As redis-py's PubSub.connection, for `connection.is_connected`.)"""
        return self if self._started else None

    @property
    def is_connected(self) -> bool:
        return self._started and self._failed is None

    async def connect(self) -> None:
        """Learn the cluster's slots (a no-op once known)."""
        if self._failed is not None:
            raise redis.ConnectionError(f"shard channels lost: {self._failed}")
        await self.cluster.initialize()
        self._started = True

    async def subscribe(self, *channels: str | bytes) -> None:
        await self.connect()
        try:
            for where, names in self._channels.by_slot(channels, self.cluster.get_node_from_key):
                conn = await self._conn(where)
                await conn.send_command("SSUBSCRIBE", *names)
        except (redis.ConnectionError, OSError) as exc:
            await self._fail(exc)
            raise redis.ConnectionError(f"shard channel subscribe failed: {exc}") from exc

    async def unsubscribe(self, *channels: str | bytes) -> None:
        for where, names in self._channels.leaving(channels):
            if where in self._conns and self._failed is None:
                await self._conns[where].send_command("SUNSUBSCRIBE", *names)

    async def get_message(self, timeout: float | None = 0.0) -> dict[str, Any] | None:
        """The next message, or None after `timeout` seconds (None: wait for one)."""
        while True:
            if self._failed is not None:
                raise redis.ConnectionError(f"shard channels lost: {self._failed}")
            try:
                reply = await wait_within(self._replies.get(), timeout)
            except TimeoutError:
                return None
            if isinstance(reply, BaseException):
                await self._fail(reply)
                continue
            try:
                message = self._channels.message(reply)
            except redis.ConnectionError as exc:
                await self._fail(exc)
                raise
            if message is not None:
                return message

    async def _conn(self, where: Node) -> redis.asyncio.Connection:
        if where not in self._conns:
            pool = redis.asyncio.ConnectionPool.from_url(node_url(self.url, *where), **self.kwargs)
            conn = pool.make_connection()
            await conn.connect()
            self._conns[where] = conn
            self._readers.append(asyncio.create_task(self._read(conn), name=f"genq-shard-pubsub-{where[1]}"))
        return self._conns[where]

    async def _read(self, conn: redis.asyncio.Connection) -> None:
        while True:
            try:
                reply = await conn.read_response(timeout=None)
            except Exception as exc:  # a lost node, or MOVED for a slot served elsewhere now
                self._replies.put_nowait(exc)
                return
            self._replies.put_nowait(reply)

    async def _fail(self, exc: BaseException) -> None:
        """Broken for good: the next call raises; the cluster client reads the slots' nodes
        again, so the reader's next AsyncShardPubSub goes where they are now."""
        if self._failed is None:
            self._failed = exc
            with contextlib.suppress(redis.RedisError, OSError):
                await self.cluster.nodes_manager.initialize()

    async def aclose(self) -> None:
        for task in self._readers:
            task.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        self._readers.clear()
        for conn in self._conns.values():
            with contextlib.suppress(redis.RedisError, OSError):
                await conn.disconnect()
        self._conns.clear()


class AsyncShardChannels:
    """What the asyncio readers make their events PubSubs with on a Redis 7 cluster (where
    elsewhere they use the client itself): `pubsub()` and `aclose()`."""

    def __init__(self, url: str, cluster: Any, **kwargs: Any) -> None:
        self.url = url
        self.cluster = cluster
        self.kwargs = kwargs

    def pubsub(self) -> AsyncShardPubSub:
        return AsyncShardPubSub(self.cluster, self.url, **self.kwargs)

    async def aclose(self) -> None:
        """(Each AsyncShardPubSub closes its own connections.)"""


def connect_async_events(url: str, cluster: Any, sharded: bool, **kwargs: Any) -> Any:
    """What asyncio readers follow jobs' events on: shard channels on a Redis 7 cluster
    (`Keys.sharded_pubsub`), else `producer.redis_conn.connect_async_pubsub`'s."""
    return AsyncShardChannels(url, cluster, **kwargs) if sharded else connect_async_pubsub(url, cluster, **kwargs)
