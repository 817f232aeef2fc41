"""A worker through a Redis outage: it keeps its engine and its requests, and waits.

Each of the consumer's tasks retries on its own (the publisher its writes, the heartbeat its
beat, intake and reclaimer their reads, the listeners their subscriptions); `Outage` makes
each say once that Redis is gone and once that it is back, not once per retry.

arq hosts the process, and its main loop polls its own (empty) queue and writes its
health-check key every `poll_delay`. With arq's own pool a connection error there ended the
process, engine and running requests with it: a Redis restart, a failover or a network
blip of a few seconds took every worker down. `PatientPool` makes arq's loop wait as well.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import redis
import redis.asyncio
from arq.connections import ArqRedis

from producer.redis_conn import REDIS_AWAY, connect_async, is_cluster_url, plain_url

logger = logging.getLogger(__name__)

RETRY_BASE_S = 0.1  # arq's first wait after a failed command; doubled each time, up to RETRY_MAX_S
RETRY_MAX_S = 2.0  # Redis is tried at least this often while it is away
# (producer.redis_conn.REDIS_AWAY: a Redis Cluster's CLUSTERDOWN too, which every node answers,
# blocked reads included, until a replica takes over a lost master: with a shard's stream on
# each master, a worker's reads on the live ones saw it at once)
REDIS_ERRORS = REDIS_AWAY
CONNECT_TIMEOUT_S = 5.0  # a Redis host gone from the network fails a connect in this, not minutes


class Outage:
    """What one task says of an outage: a warning at its first failure, a line when Redis
    answers again, and nothing for the retries between."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.down_since: float | None = None  # time.monotonic() of the first failure

    def failed(self, exc: BaseException) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            logger.warning("%s: Redis unreachable (%s); retrying until it is back", self.what, exc)

    def answered(self) -> None:
        if self.down_since is not None:
            logger.info("%s: Redis answers again after %.1f s", self.what, time.monotonic() - self.down_since)
            self.down_since = None


class PatientPool(ArqRedis):
    """arq's Redis: a command that cannot reach Redis is tried again, with back-off, for as
    long as arq's main task runs (set by `hold_on`, from `on_startup`). Before that, while
    arq starts, it fails at once: a worker that cannot reach Redis should say so, not hang.
    After it (a SIGTERM ended the loop) a failure is logged and answered with None: arq then
    only deletes its health-check key, which expires by itself, and genq's drain must run."""

    main_task: asyncio.Task[Any] | None = None
    # On a Redis Cluster, arq's commands (single-key: its queue's ZRANGEBYSCORE, its
    # health-check key) go through a cluster client, which sends each to its key's node.
    cluster_client: redis.asyncio.Redis | None = None

    def hold_on(self, main_task: asyncio.Task[Any]) -> None:
        self.main_task = main_task

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        outage = Outage(f"arq's {args[0]}")
        failures = 0
        while True:
            try:
                if self.cluster_client is not None:
                    reply = await self.cluster_client.execute_command(*args, **options)
                else:
                    reply = await super().execute_command(*args, **options)
            except REDIS_ERRORS as exc:
                if self.main_task is None:
                    raise
                if self.main_task.done():
                    logger.warning("arq's %s skipped at shutdown: Redis unreachable (%s)", args[0], exc)
                    return None
                outage.failed(exc)
                failures += 1
                await asyncio.sleep(min(RETRY_MAX_S, RETRY_BASE_S * 2**failures))
                continue
            outage.answered()
            return reply


def patient_pool(redis_url: str) -> PatientPool:
    """The pool arq's Worker takes as `redis_pool` (its `redis_settings` still serve
    `arq --check`). Connections are made on first use, inside arq's event loop."""
    pool = PatientPool.from_url(plain_url(redis_url), socket_connect_timeout=CONNECT_TIMEOUT_S)
    if is_cluster_url(redis_url):
        pool.cluster_client = connect_async(redis_url, socket_connect_timeout=CONNECT_TIMEOUT_S)
    return pool
