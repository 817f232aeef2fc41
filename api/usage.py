"""Metered usage, as workers count it (`Keys.usage(day)`: each finished job's tokens, once,
under its tenant, the id of the API key it came with, and its model): read for `GET
/v1/usage` and `genq usage`."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from api.status_cli import text_table
from producer.async_client import AsyncClient
from producer.protocol import DEFAULT_PREFIX

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
    pipe = client.redis.pipeline(transaction=False)
    for day in dates:
        pipe.hgetall(client.keys.usage(day))
    rows: list[dict[str, Any]] = []
    for day, fields in zip(dates, await pipe.execute(), strict=True):
        by_group: dict[tuple[str, str], dict[str, Any]] = {}
        for name, value in fields.items():
            who, model, metric = name.decode().split("\t")
            if metric not in METRICS or (tenant is not None and who != tenant):
                continue
            row = by_group.setdefault((who, model), {"day": day, "tenant": who, "model": model,
                                                     **dict.fromkeys(METRICS, 0)})
            row[metric] = int(value)
        rows += [by_group[k] for k in sorted(by_group)]
    for row in rows:
        row["total_tokens"] = row["prompt_tokens"] + row["completion_tokens"]
    return rows


# -- genq usage ------------------------------------------------------------------------------


def build(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="Redis key prefix (default: %(default)s)")
    parser.add_argument("--days", type=int, default=30, help="how many days back, today included (default 30)")
    parser.add_argument("--tenant", help="one tenant's rows (an API key's id, as GET /v1/usage names it)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    return run


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.days <= MAX_DAYS:
        raise SystemExit(f"genq usage: --days must be in [1, {MAX_DAYS}]")
    rows = asyncio.run(_rows(args.redis_url, args.prefix, args.days, args.tenant))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = ("day", "tenant", "model", *METRICS, "total_tokens")
    table = [header] + [(r["day"], r["tenant"] or "-", r["model"], *(str(r[m]) for m in header[3:])) for r in rows]
    print("\n".join(text_table(table)))
    return 0


async def _rows(redis_url: str, prefix: str, days: int, tenant: str | None) -> list[dict[str, Any]]:
    client = AsyncClient(redis_url, prefix)
    try:
        return await read_usage(client, days, tenant)
    finally:
        await client.aclose()
