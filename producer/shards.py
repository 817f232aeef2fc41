"""How many shards the request streams are split over, the same in every process.

On a single Redis there is one, always. On a Redis Cluster the first process to use a prefix
records its number (its `GENQ_REDIS_SHARDS`, else DEFAULT_CLUSTER_SHARDS) under
`Keys.shards_record`; every later process takes the recorded number, and one told another
number refuses to start, naming both: a worker reading 6 shards of jobs submitted over 12
would never see half of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, cast

from producer.protocol import DEFAULT_CLUSTER_SHARDS, MAX_SHARDS, SHARDS_ENV, Keys


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


def resolve_shards(conn: Any, keys: Keys, wanted: int | None = None) -> Keys:
    """`keys` with the number of shards every process uses (blocking client)."""
    if not keys.cluster:
        return _off_cluster(keys, wanted)
    recorded = wanted or DEFAULT_CLUSTER_SHARDS
    if not conn.set(keys.shards_record, recorded, nx=True):
        recorded = cast(Any, conn.get(keys.shards_record))
    return _settled(keys, recorded, wanted)


async def resolve_shards_async(conn: Any, keys: Keys, wanted: int | None = None) -> Keys:
    """`keys` with the number of shards every process uses (asyncio client)."""
    if not keys.cluster:
        return _off_cluster(keys, wanted)
    recorded = wanted or DEFAULT_CLUSTER_SHARDS
    if not await conn.set(keys.shards_record, recorded, nx=True):
        recorded = await conn.get(keys.shards_record)
    return _settled(keys, recorded, wanted)
