"""Shard channels on a one-master Redis 7 cluster (producer.shard_pubsub): what the readers get,
and a node giving a channel up (its slot taken from it, as a reshard does) raised as a lost
connection, so that a reader subscribes anew and replays. (The queue's tests on a three-master
cluster, tests/queue/test_queue_cluster.py, stream real jobs through failovers on it.)"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.cluster

from producer.redis_cluster import RedisClusterNodes
from producer.redis_conn import connect, connect_async
from producer.redis_server import find_redis7_server
from producer.shard_pubsub import AsyncShardPubSub, ShardPubSub

TIMEOUT_S = 10.0
CHANNELS = [b"t:{s0}events:a", b"t:{s0}events:b", b"t:{s1}events:c"]  # two slots


@pytest.fixture(scope="module")
def one_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    if (binary := find_redis7_server()) is None:
        pytest.skip("no Redis 7 in the virtualenv (the set-up found no apt-get)")
    nodes = RedisClusterNodes(Path(tmp_path_factory.mktemp("one-master")), masters=1, replicas=0,
                              binary=binary).start()
    yield nodes
    nodes.stop()


def _take_slot_away(nodes: RedisClusterNodes, channel: bytes) -> None:
    """The master stops serving the channel's slot (then serves it again: the slot is whole
    for the next test)."""
    node = redis.Redis(port=int(nodes.servers[0].port or 0))
    slot = redis.cluster.key_slot(channel)
    node.execute_command("CLUSTER", "DELSLOTS", slot)
    node.execute_command("CLUSTER", "ADDSLOTS", slot)
    node.close()


def test_a_shard_pubsub_reads_messages_of_every_slot_and_raises_when_a_slot_is_taken(
    one_master: RedisClusterNodes,
) -> None:
    cluster = connect(one_master.url)
    pubsub = ShardPubSub(cluster, one_master.url)
    try:
        pubsub.subscribe(*CHANNELS)
        confirmed = [pubsub.get_message(TIMEOUT_S) for _ in CHANNELS]
        assert sorted((m or {})["channel"] for m in confirmed) == sorted(CHANNELS)
        assert {(m or {})["type"] for m in confirmed} == {"subscribe"}
        assert pubsub.get_message(0.05) is None
        for channel in CHANNELS:
            assert cluster.spublish(channel, b"event " + channel) == 1
        got = [pubsub.get_message(TIMEOUT_S) for _ in CHANNELS]
        assert [((m or {})["type"], (m or {})["channel"], (m or {})["data"]) for m in got] == [
            ("message", c, b"event " + c) for c in CHANNELS]
        pubsub.unsubscribe(CHANNELS[1])  # (one asked to leave is no loss, followed again or not)
        pubsub.subscribe(CHANNELS[1])
        pubsub.unsubscribe(CHANNELS[1])
        assert [(pubsub.get_message(TIMEOUT_S) or {})["type"] for _ in range(3)] == [
            "unsubscribe", "subscribe", "unsubscribe"]
        _take_slot_away(one_master, CHANNELS[2])
        with pytest.raises(redis.ConnectionError, match="gave up shard channel"):
            while pubsub.get_message(TIMEOUT_S) is not None:
                pass
    finally:
        pubsub.close()
        cluster.close()


async def test_an_async_shard_pubsub_reads_messages_and_raises_when_a_slot_is_taken(
    one_master: RedisClusterNodes,
) -> None:
    cluster = connect_async(one_master.url)
    pubsub = AsyncShardPubSub(cluster, one_master.url)
    try:
        await pubsub.subscribe(*CHANNELS)
        confirmed = [await pubsub.get_message(TIMEOUT_S) for _ in CHANNELS]
        assert sorted((m or {})["channel"] for m in confirmed) == sorted(CHANNELS)
        assert pubsub.connection is not None and pubsub.connection.is_connected
        publisher = connect(one_master.url)  # (the asyncio cluster client has no SPUBLISH)
        for channel in CHANNELS:
            publisher.spublish(channel, b"event " + channel)
        publisher.close()
        got = [await pubsub.get_message(TIMEOUT_S) for _ in CHANNELS]
        assert [((m or {})["type"], (m or {})["channel"]) for m in got] == [("message", c) for c in CHANNELS]
        assert await pubsub.get_message(0.05) is None
        await asyncio.to_thread(_take_slot_away, one_master, CHANNELS[0])
        with pytest.raises(redis.ConnectionError, match="gave up shard channel"):
            while await pubsub.get_message(TIMEOUT_S) is not None:
                pass
        assert not pubsub.connection.is_connected
    finally:
        await pubsub.aclose()
        await cluster.aclose()
