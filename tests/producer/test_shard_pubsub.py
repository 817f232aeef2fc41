"""Shard channels on a one-master Redis 7 cluster (producer.shard_pubsub): what the readers get,
and a node giving a channel up (its slot taken from it, as a reshard does) raised as a lost
connection, so that a reader subscribes anew and replays. (The queue's tests on a three-master
cluster, tests/queue/test_queue_cluster.py, stream real jobs through failovers on it.)"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.cluster

from producer.client import Client
from producer.protocol import EVENT_FIELD, Event, encode_event
from producer.redis_cluster import RedisClusterNodes
from producer.redis_conn import connect, connect_async
from producer.redis_server import find_redis7_server
from producer.sampling_params import SamplingParams
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


def test_a_follow_begun_while_the_cluster_is_down_waits_it_out(one_master: RedisClusterNodes) -> None:
    """While a master is lost (until its replica takes over) every node answers CLUSTERDOWN,
    reads included, and redis-py raises it after a few tries within a second. A client's follow
    begun then waits it out as an outage (producer.redis_conn.REDIS_AWAY), and has the job's
    events once the cluster is whole. Here the cluster is down for a slot taken away: the
    blocking client's slot map takes a cluster with a slot unserved; the asyncio client's
    refuses one (a lost master's slots stay assigned to it), so it is not run here."""
    node = redis.Redis(port=int(one_master.servers[0].port or 0))
    with Client(one_master.url, prefix="down:") as client:
        handle = client.submit("Hi", SamplingParams(max_tokens=2))
        events_key = client.keys.events(handle.id)
        other_slot = (redis.cluster.key_slot(events_key.encode()) + 1) % 16384
        downs = lambda: int(node.info("errorstats").get("errorstat_CLUSTERDOWN", {}).get("count", 0))  # noqa: E731
        follower = _Follower(one_master.url, client.keys.prefix, handle.id)
        follower.ready.wait(TIMEOUT_S)  # (its client made while the cluster is whole)
        node.execute_command("CLUSTER", "DELSLOTS", other_slot)
        try:
            _wait(lambda: b"cluster_state:fail" in node.execute_command("CLUSTER", "INFO"))
            before = downs()
            follower.go.set()
            # (more answers than redis-py's own tries: the client tried again itself)
            _wait(lambda: downs() >= before + 12 or not follower.thread.is_alive())
            assert follower.thread.is_alive(), f"the follow gave up: {follower.got}"
        finally:
            node.execute_command("CLUSTER", "ADDSLOTS", other_slot)
        _wait(lambda: b"cluster_state:ok" in node.execute_command("CLUSTER", "INFO"))
        event = encode_event(Event(seq=0, token_ids=[5, 6], text="ok", finished=True, finish_reason="length"))
        node.xadd(events_key, {EVENT_FIELD: event})
        node.execute_command("SPUBLISH" if client.keys.sharded_pubsub else "PUBLISH", events_key, event)
        follower.thread.join(TIMEOUT_S * 2)
        assert not follower.thread.is_alive() and follower.got == [[5, 6]]
    node.close()


class _Follower:
    """A thread that makes a blocking client, says it is `ready`, and once told to `go` streams
    the job: its tokens, or the error that ended the stream, in `got`."""

    def __init__(self, url: str, prefix: str, job_id: str) -> None:
        self.ready, self.go, self.got = threading.Event(), threading.Event(), []
        self.thread = threading.Thread(target=self._caught, args=(self._blocking,), daemon=True)
        self.url, self.prefix, self.job_id = url, prefix, job_id
        self.thread.start()

    def _caught(self, target: Callable[[], None]) -> None:
        try:
            target()
        except Exception as exc:  # (reported by the test)
            self.got.append(exc)

    def _blocking(self) -> None:
        with Client(self.url, prefix=self.prefix) as client:
            self.ready.set()
            self.go.wait(TIMEOUT_S * 3)
            self.got.append([t for delta in client.stream(self.job_id, TIMEOUT_S * 3) for t in delta.token_ids])


def _wait(condition: Callable[[], Any], timeout_s: float = TIMEOUT_S * 2) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.01)
