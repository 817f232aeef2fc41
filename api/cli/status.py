"""`genq status`: what the cluster is doing, from a shell: each queue's depth, each live
worker's load, the dead letters. Read from Redis alone (the heartbeats, the streams), as the
API's /metrics reads it.

    queue      stream                 queued  running  high  low
    (shared)   genq:requests               3        5     1    0
    qwen       genq:requests:qwen          0        2     0    0

    worker  model     queue     state    running  waiting  free  kv%   hit%  handed  tok/s
    w1      llama-8b  (shared)  serving    5/128        0     3  41.0  62.5      14  812.5

(queued and running: over the queue's priority lanes; high and low: the jobs of those lanes
queued, priority < 0 and > 0. A worker's running: of the requests it runs at once, its
max_num_seqs or fewer where Whisper's audio slots do not fit. hit%: of the prompt tokens looked
up, those the prefix cache held; handed: jobs other workers handed this one by prefix-cache
affinity.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from api.cluster import Cluster, QueueDepth
from producer.async_client import AsyncClient
from producer.protocol import DEFAULT_PREFIX, Keys

SHARED = "(shared)"  # how the shared stream's queue is shown


def build(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="Redis key prefix (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    return run


def run(args: argparse.Namespace) -> int:
    status = asyncio.run(_status(args.redis_url, args.prefix))
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


async def _status(redis_url: str, prefix: str) -> dict[str, Any]:
    client = AsyncClient(redis_url, prefix)
    try:
        cluster = Cluster(client.redis, client.keys)
        workers = sorted(await cluster.workers(), key=lambda w: (w.info.queue, w.name))
        depths = await cluster.queue_depths()
        return {
            "queues": [_queue(_stream(client.keys.on_queue(q)), q, d) for q, d in depths.items()],
            "workers": [{"name": w.name, **asdict(w.info)} for w in workers],
            "shards": client.keys.shards,
            "dead_letters": sum([await client.redis.xlen(k.dead) for k in client.keys.every_shard]),
        }
    finally:
        await client.aclose()


def _stream(keys: Keys) -> str:
    """A queue's stream (its first shard's, and how many more a Redis Cluster splits it over)."""
    return keys.requests + (f" (+{keys.shards - 1} shards)" if keys.shards > 1 else "")


def _queue(stream: str, queue: str, depth: QueueDepth) -> dict[str, Any]:
    lanes = {lane or "normal": {"undelivered": d.undelivered, "pending": d.pending} for lane, d in depth.lanes.items()}
    return {"queue": queue, "stream": stream, "undelivered": depth.undelivered, "pending": depth.pending, "lanes": lanes}


def _state(worker: dict[str, Any]) -> str:
    """A worker's state, with its sleep level or pause where it has one."""
    if worker["sleep_level"]:
        return f"asleep:{worker['sleep_level']}"
    return "paused" if worker["paused"] else str(worker["state"])


def format_status(status: dict[str, Any]) -> str:
    queues = [("queue", "stream", "queued", "running", "high", "low")] + [
        (q["queue"] or SHARED, q["stream"], str(q["undelivered"]), str(q["pending"]),
         *(str(q["lanes"].get(lane, {}).get("undelivered", 0)) for lane in ("high", "low")))
        for q in status["queues"]
    ]
    workers = [("worker", "model", "queue", "state", "running", "waiting", "free", "kv%", "hit%", "handed", "tok/s",
                "weights")] + [
        (w["name"], w["model"], w["queue"] or SHARED, _state(w),
         f"{w['running']}/{w['max_num_seqs']}", str(w["waiting"]),
         str(w["free_slots"]), f"{100 * w['kv_cache_usage']:.1f}", _hit_rate(w), str(w["affinity_handoffs_taken_total"]),
         f"{w['tokens_per_s']:.1f}", _weights(w))
        for w in status["workers"]
    ]
    lines = text_table(queues) + [""]
    lines += text_table(workers) if status["workers"] else ["no live worker"]
    return "\n".join([*lines, "", f"dead letters: {status['dead_letters']} (genq dead ls)"])


def _weights(worker: dict[str, Any]) -> str:
    """The weights update it serves ("-": none), "!" after one whose checkpoint it could not read."""
    update = worker["weights_update"]
    return f"{update}{'!' if worker['weights_error'] else ''}" if update else "-"


def _hit_rate(worker: dict[str, Any]) -> str:
    """The share of prompt tokens the prefix cache held, since the worker started."""
    queries = worker["prefix_cache_queries_total"]
    return f"{100 * worker['prefix_cache_hits_total'] / queries:.1f}" if queries else "-"


def text_table(rows: list[tuple[str, ...]]) -> list[str]:
    """Left-aligned text columns, right-aligned numbers, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    numeric = [all(_is_number(row[i]) for row in rows[1:]) for i in range(len(widths))]
    return ["  ".join(cell.rjust(w) if num else cell.ljust(w) for cell, w, num in zip(row, widths, numeric, strict=True)).rstrip()
            for row in rows]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
