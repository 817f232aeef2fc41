"""How many shards the request streams are split over, the same in every process, and
whether a cluster's events channels are shard channels.

On a single Redis there is one, always. On a Redis Cluster the first process to use a prefix
records its number (its `GENQ_REDIS_SHARDS`, else DEFAULT_CLUSTER_SHARDS) under
`Keys.shards_record`; every later process takes the recorded number, and one told another
number refuses to start, naming both: a worker reading 6 shards of jobs submitted over 12
would never see half of them.

A Redis 7 cluster has sharded pub/sub: there each job's events go out with SPUBLISH on its
slot's nodes and are read with SSUBSCRIBE (`Keys.sharded_pubsub`), where a PUBLISH would cost
every node of the cluster. Every process asks the cluster's version here, so all of them
agree: one node is asked (a cluster runs one version; mid-upgrade, restart the processes once
every node runs 7).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, cast

from producer.protocol import DEFAULT_CLUSTER_SHARDS, MAX_SHARDS, SHARDS_ENV, Keys

SHARDED_PUBSUB_SINCE = 7  # the Redis major version with SPUBLISH / SSUBSCRIBE


class ShardsMismatch(ValueError):
    """This process was told a number of shards other than the one the cluster records."""


def shards_from_env(env: Mapping[str, str]) -> int | None:
    """GENQ_REDIS_SHARDS as a number; None when unset (take the recorded one)."""
    raw = env.get(SHARDS_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_SHARDS:
        raise ValueError(f"{SHARDS_ENV}={raw!r}: expected a whole number from 1 to {MAX_SHARDS}")
    return int(raw)


def _off_cluster(keys: Keys, wanted: int | None) -> Keys:
    if wanted not in (None, 1):
        raise ValueError(f"{SHARDS_ENV}={wanted}: a single Redis has one request-stream shard; "
                         "shards are for a Redis Cluster (a redis+cluster:// URL)")
    return keys


def _settled(keys: Keys, recorded: Any, wanted: int | None) -> Keys:
    """`keys` with the recorded number of shards, or ShardsMismatch."""
    text = recorded.decode() if isinstance(recorded, bytes) else str(recorded)
    if not text.isdigit() or not 1 <= int(text) <= MAX_SHARDS:
        raise ValueError(f"{keys.shards_record} holds {text!r}, not a number of shards from 1 to {MAX_SHARDS}")
    if wanted is not None and wanted != int(text):
        raise ShardsMismatch(
            f"{SHARDS_ENV}={wanted}, but the request streams under prefix {keys.prefix!r} are split over "
            f"{text} shards ({keys.shards_record}, written by the first process to use them): leave "
            f"{SHARDS_ENV} unset to use {text}, or drain every queue and delete {keys.shards_record} to change it")
    return replace(keys, shards=int(text))


def _sharded_pubsub(keys: Keys, info: Any) -> Keys:
    """`keys` with sharded pub/sub where the node's INFO says Redis 7 or later."""
    major = str(info.get("redis_version", "0")).split(".")[0]
    return replace(keys, sharded_pubsub=major.isdigit() and int(major) >= SHARDED_PUBSUB_SINCE)


def resolve_shards(conn: Any, keys: Keys, wanted: int | None = None) -> Keys:
    """`keys` with the number of shards every process uses, and its pub/sub (blocking client)."""
    if not keys.cluster:
        return _off_cluster(keys, wanted)
    recorded = wanted or DEFAULT_CLUSTER_SHARDS
    if not conn.set(keys.shards_record, recorded, nx=True):
        recorded = cast(Any, conn.get(keys.shards_record))
    keys = _settled(keys, recorded, wanted)
    return _sharded_pubsub(keys, conn.execute_command("INFO", "server", target_nodes=conn.get_random_node()))


async def resolve_shards_async(conn: Any, keys: Keys, wanted: int | None = None) -> Keys:
    """`keys` with the number of shards every process uses, and its pub/sub (asyncio client)."""
    if not keys.cluster:
        return _off_cluster(keys, wanted)
    recorded = wanted or DEFAULT_CLUSTER_SHARDS
    if not await conn.set(keys.shards_record, recorded, nx=True):
        recorded = await conn.get(keys.shards_record)
    keys = _settled(keys, recorded, wanted)
    return _sharded_pubsub(keys, await conn.execute_command("INFO", "server", target_nodes=conn.get_random_node()))
