"""How long a command to the workers of a model takes to be acted on: told on `genq:control`
(what the API and the `genq` commands do) against the record alone, which each worker reads
at its next heartbeat (what a command written by hand without a PUBLISH gets).

One `genq worker` (default model, the default 5 s heartbeat) on an embedded Redis. Each round
pauses the model (mode keep) and resumes it, and times each from the record's write until the
worker's heartbeat says it acted on it, in both ways:

    python benchmarks/commands.py [--rounds 5] [--heartbeat-s 5]

Prints each way's median and worst seconds, then the ratio, heartbeat over told.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from worker_procs import running_workers

from api.cluster import Cluster
from api.weights_updates import write_command
from producer.async_client import AsyncClient
from producer.records import decode_worker_info
from producer.redis_server import RedisServer

PREFIX = "bench-commands:"
MODEL = "m"
POLL_S = 0.01


async def act(client: AsyncClient, cluster: Cluster, paused: bool, told: bool) -> float:
    """Seconds from writing a pause (or resume) until the worker's heartbeat says it made it."""
    key = client.keys.pause(MODEL)
    fields: dict[str, str | int] = {"paused": int(paused), "mode": "keep"}
    start = time.perf_counter()
    if told:
        count = await write_command(client, cluster, key, fields)
    else:  # the record alone, as written by hand without the PUBLISH
        async with client.redis.pipeline(transaction=True) as pipe:
            pipe.hincrby(key, "count", 1)
            pipe.hset(key, mapping=fields)
            count, _ = await pipe.execute()
    while decode_worker_info(await client.redis.hgetall(client.keys.worker("w"))).pause_command < count:
        await asyncio.sleep(POLL_S)  # polling the condition, as the API's confirmation does
    return time.perf_counter() - start


async def measure(url: str, rounds: int) -> dict[str, list[float]]:
    client = AsyncClient(url, PREFIX)
    cluster = Cluster(client.redis, client.keys)
    seconds: dict[str, list[float]] = {"told": [], "heartbeat": []}
    try:
        for _ in range(rounds):
            for way in seconds:
                for paused in (True, False):
                    seconds[way].append(await act(client, cluster, paused, told=way == "told"))
    finally:
        await client.aclose()
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--heartbeat-s", type=float, default=5.0)
    args = parser.parse_args()
    worker_args = ["--served-model-name", MODEL, "--heartbeat-s", str(args.heartbeat_s),
                   "--claim-idle-s", str(max(30.0, 2 * args.heartbeat_s)), "--num-threads", "1"]
    with RedisServer() as server, running_workers(server.url, PREFIX, ["w"], worker_args):
        seconds = asyncio.run(measure(server.url, args.rounds))
    for way, values in seconds.items():
        print(f"{way:>9}: median {statistics.median(values):.3f} s, worst {max(values):.3f} s ({len(values)} commands)")
    ratio = statistics.median(seconds["heartbeat"]) / statistics.median(seconds["told"])
    print(f"heartbeat / told (median): {ratio:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
