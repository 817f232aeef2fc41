"""`genq keys`: the API keys kept in Redis (api.api_keys), each with its own limits and models.

    genq keys create NAME [--rpm N] [--tpm N] [--max-in-flight N] [--models a,b] [--priority N]   # prints it, once
    genq keys set NAME [--rpm N|default] [--tpm ...] [--max-in-flight ...] [--models a,b|all] [--priority N]
    genq keys ls                                              # names, limits, models
    genq keys revoke NAME
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from api import api_keys
from api.api_keys import KeyPlan
from api.cli.status import text_table
from producer.cli import printed
from producer.protocol import DEFAULT_PREFIX, Keys
from producer.redis_conn import connect_async, is_cluster_url


def build(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="Redis key prefix (default: %(default)s)")
    sub = parser.add_subparsers(dest="action", required=True)
    create = sub.add_parser("create", help="make a key and print it (the only time it is shown)")
    create.add_argument("name", help="its usage is metered under this name (genq usage)")
    create.add_argument("--rpm", type=int, help="requests per minute (default: GENQ_RATE_LIMIT_RPM)")
    create.add_argument("--tpm", type=int, help="tokens per minute (default: GENQ_RATE_LIMIT_TPM)")
    create.add_argument("--models", help="comma-separated model names it may use (default: every model)")
    create.add_argument("--priority", type=int, default=0,
                        help="added to its requests' priority, lower first: a tier (default 0)")
    create.add_argument("--max-in-flight", type=int,
                        help="its jobs queued or running at once; past it, 429 (default: no limit)")
    change = sub.add_parser("set", help="change a key's limits, models or priority (the key stays the same)")
    change.add_argument("name")
    for limit in ("--rpm", "--tpm", "--max-in-flight"):
        change.add_argument(limit, type=_limit_arg, help="a number, or 'default' for the server's")
    change.add_argument("--models", help="comma-separated model names, or 'all'")
    change.add_argument("--priority", type=int)
    sub.add_parser("ls", help="the keys' names, limits and models")
    sub.add_parser("revoke", help="delete a key: its requests get 401 within a second").add_argument("name")
    return run


def run(args: argparse.Namespace) -> int:
    return printed("keys", _run(args), ValueError)


async def _run(args: argparse.Namespace) -> str:
    conn, keys = connect_async(args.redis_url), Keys(args.prefix, cluster=is_cluster_url(args.redis_url))
    try:
        if args.action == "create":
            models = _models(args.models) if args.models is not None else None
            return await api_keys.create(conn, keys, KeyPlan(args.name, args.rpm, args.tpm, models,
                                                             priority=args.priority, max_in_flight=args.max_in_flight))
        if args.action == "set":
            changes = {k: v for k in ("rpm", "tpm", "max_in_flight", "priority")
                       if (v := getattr(args, k)) is not None}
            if args.models is not None:
                changes["models"] = None if args.models == "all" else _models(args.models)
            if not changes:
                raise ValueError("name what to change: --rpm, --tpm, --max-in-flight, --models or --priority")
            plan = await api_keys.update(conn, keys, args.name, **{k: _unset(v) for k, v in changes.items()})
            return _table([plan])
        if args.action == "revoke":
            if not await api_keys.revoke(conn, keys, args.name):
                raise ValueError(f"no key named {args.name!r}")
            return f"revoked {args.name}"
        return _table(await api_keys.listing(conn, keys))
    finally:
        await conn.aclose()


def _table(plans: list[KeyPlan]) -> str:
    if not plans:
        return "no keys (the API is open unless GENQ_API_KEYS is set)"
    rows: list[tuple[str, ...]] = [("NAME", "RPM", "TPM", "IN-FLIGHT", "MODELS", "PRIORITY", "CREATED")]
    for plan in plans:
        created = time.strftime("%Y-%m-%d %H:%M", time.gmtime(plan.created_at))
        rows.append((plan.name, _limit(plan.rpm), _limit(plan.tpm), _limit(plan.max_in_flight),
                     ",".join(plan.models) if plan.models is not None else "all", str(plan.priority), created))
    return "\n".join(text_table(rows))


DEFAULT = "default"  # `genq keys set --rpm default`: back to the server's limit


def _limit_arg(text: str) -> int | str:
    if text == DEFAULT:
        return DEFAULT
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number or 'default', got {text!r}") from None


def _unset(value: object) -> object:
    return None if value == DEFAULT else value


def _models(text: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in text.split(","))


def _limit(value: int | None) -> str:
    return str(value) if value is not None else "default"
