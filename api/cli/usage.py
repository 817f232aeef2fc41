"""`genq usage [--days N] [--tenant ID] [--json]`: metered usage (api.usage) from a shell, a row per
day, tenant and model, as `GET /v1/usage` reads it."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from typing import Any

from api.cli.status import text_table
from api.usage import MAX_DAYS, METRICS, read_usage
from producer.async_client import AsyncClient
from producer.protocol import DEFAULT_PREFIX


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
