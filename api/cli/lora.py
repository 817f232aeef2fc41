"""`genq lora`: the runtime LoRA registry from a shell, as /v1/load_lora_adapter and
/v1/unload_lora_adapter keep it (api.lora_adapters: the same checks, the same wait for every
live worker).

    genq lora add NAME PATH      # every live worker serves it, or the reason it cannot
    genq lora rm NAME
    genq lora ls                 # the registry, and which workers serve or refused each
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from api import lora_adapters
from api.cluster import Cluster
from api.errors import APIError
from producer.async_client import AsyncClient
from producer.cli import printed
from producer.protocol import DEFAULT_PREFIX


def build(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="Redis key prefix (default: %(default)s)")
    sub = parser.add_subparsers(dest="action", required=True)
    add = sub.add_parser("add", help="register an adapter; returns once every live worker serves it")
    add.add_argument("name")
    add.add_argument("path", help="the adapter's PEFT directory, as the workers see it")
    sub.add_parser("rm", help="unregister an adapter").add_argument("name")
    sub.add_parser("ls", help="the registry and what the workers serve")
    return run


def run(args: argparse.Namespace) -> int:
    return printed("lora", _run(args), APIError)


async def _run(args: argparse.Namespace) -> str:
    client = AsyncClient(args.redis_url, args.prefix)
    try:
        cluster = Cluster(client.redis, client.keys)
        if args.action == "add":
            return await lora_adapters.load(client, cluster, args.name, args.path)
        if args.action == "rm":
            return await lora_adapters.unload(client, cluster, args.name)
        return await _listing(client, cluster)
    finally:
        await client.aclose()


async def _listing(client: AsyncClient, cluster: Cluster) -> str:
    registry = {k.decode(): v.decode() for k, v in (await client.redis.hgetall(client.keys.lora_adapters)).items()}
    workers = [w for w in await cluster.workers() if w.serving]
    lines = []
    for name in sorted(set(registry) | {a for w in workers for a in w.info.adapters}):
        serving = [w.name for w in workers if name in w.info.adapters]
        refused = [f"{w.name} ({w.info.adapter_errors[name]})" for w in workers if name in w.info.adapter_errors]
        source = registry.get(name, "given at worker start (--lora-modules)")
        line = f"{name}\t{source}\tserved by: {', '.join(serving) or 'none'}"
        lines.append(line + (f"\trefused by: {'; '.join(refused)}" if refused else ""))
    return "\n".join(lines) or "no LoRA adapters"
