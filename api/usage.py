"""Metered usage, as workers count it (`Keys.usage(day)`: each finished job's tokens, once,
under its tenant, the id of the API key it came with, and its model): read for `GET
/v1/usage` and `genq usage` (api.cli.usage)."""

from __future__ import annotations

import time
from typing import Any

from producer.async_client import AsyncClient

METRICS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")
MAX_DAYS = 400  # as long as a day's hash is kept (USAGE_TTL_S)


def days_back(days: int, now: float | None = None) -> list[str]:
    """The last `days` UTC dates, today first."""
    now = time.time() if now is None else now
    return [time.strftime("%Y-%m-%d", time.gmtime(now - 86400 * i)) for i in range(days)]


async def read_usage(client: AsyncClient, days: int, tenant: str | None = None) -> list[dict[str, Any]]:
    """One row per (day, tenant, model) with usage over the last `days` days, newest day
    first; only `tenant`'s rows when it is given ("" is jobs that named none)."""
    dates = days_back(days)
    shards = client.keys.every_shard  # (a day's hash per shard on a Redis Cluster: summed)
    pipe = client.redis.pipeline(transaction=False)
    for day in dates:
        for keys in shards:
            pipe.hgetall(keys.usage(day))
    replies = await pipe.execute()
    rows: list[dict[str, Any]] = []
    for i, day in enumerate(dates):
        by_group: dict[tuple[str, str], dict[str, Any]] = {}
        for fields in replies[i * len(shards):(i + 1) * len(shards)]:
            for name, value in fields.items():
                who, model, metric = name.decode().split("\t")
                if metric not in METRICS or (tenant is not None and who != tenant):
                    continue
                row = by_group.setdefault((who, model), {"day": day, "tenant": who, "model": model,
                                                         **dict.fromkeys(METRICS, 0)})
                row[metric] += int(value)
        rows += [by_group[k] for k in sorted(by_group)]
    for row in rows:
        row["total_tokens"] = row["prompt_tokens"] + row["completion_tokens"]
    return rows
