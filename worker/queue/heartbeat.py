"""The worker's periodic and pushed control: the heartbeat (worker hash, re-owning in-flight
entries, cancel flags, deadlines) and the channel listener (cancels, handed-over entries)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable

import redis

from producer.aio import unless_set
from producer.protocol import WORKER_HEARTBEAT_TTL_S, as_text
from producer.records import (
    PauseCommand,
    SleepCommand,
    WeightsUpdate,
    WorkerInfo,
    encode_worker_info,
)
from worker.queue.config import WorkerConfig
from worker.queue.engine_thread import EngineThread
from worker.queue.jobs import (
    ABORT_CANCELLED,
    ABORT_DEADLINE,
    ABORT_PAUSED,
    HeldJob,
    JobState,
    JobTable,
)
from worker.queue.metrics import WorkerMetrics
from worker.queue.outage import REDIS_ERRORS, Outage
from worker.queue.publisher import Publisher
from worker.queue.scripts import Scripts

logger = logging.getLogger(__name__)

CANCEL_POLL_S = 1.0  # pub/sub read timeout: bounds how long a stop waits for the listener
REDIS_RETRY_S = 1.0

AbortJob = Callable[[HeldJob, str], None]


async def read_adapter_registry(scripts: Scripts) -> dict[str, str]:
    """The runtime LoRA registry: adapter name -> path."""
    registry = await scripts.conn.hgetall(scripts.keys.lora_adapters)  # type: ignore[misc]
    return {as_text(name): as_text(path) for name, path in registry.items()}


async def read_sleep_command(scripts: Scripts, model: str) -> SleepCommand | None:
    """The latest sleep or wake command for the workers of `model` (genq:sleep:<model>), if any."""
    return SleepCommand.from_hash(await scripts.conn.hgetall(scripts.keys.sleep(model)))  # type: ignore[misc]


async def read_pause_command(scripts: Scripts, model: str) -> PauseCommand | None:
    """The latest pause or resume for the workers of `model` (genq:pause:<model>), if any."""
    return PauseCommand.from_hash(await scripts.conn.hgetall(scripts.keys.pause(model)))  # type: ignore[misc]


async def read_weights_update(scripts: Scripts, model: str) -> WeightsUpdate | None:
    """The latest weights update of `model` (genq:weights:<model>), if it has had one."""
    return WeightsUpdate.from_hash(await scripts.conn.hgetall(scripts.keys.weights(model)))  # type: ignore[misc]


class Heartbeat:
    def __init__(
        self,
        config: WorkerConfig,
        scripts: Scripts,
        table: JobTable,
        publisher: Publisher,
        metrics: WorkerMetrics,
        capacity: Callable[[], int],
        abort: AbortJob,
        engine: EngineThread,
        drain: Callable[[], None],
    ) -> None:
        self.config = config
        self.drain = drain  # stop the worker as SIGTERM does (asked by `genq drain`)
        self.engine = engine
        self.registry: dict[str, str] | None = None  # the LoRA registry as last handed to the engine
        self.resets: bytes | None = None  # the prefix-cache reset count last seen (None: not yet read)
        self.scripts = scripts
        self.table = table
        self.publisher = publisher
        self.metrics = metrics
        self.capacity = capacity
        self.abort = abort
        self.state = "serving"
        self.started_at = time.time()
        self.host = socket.gethostname()
        self.ttl_s = max(WORKER_HEARTBEAT_TTL_S, int(3 * config.heartbeat_s) + 1)
        self.now = asyncio.Event()  # set: beat now, not at the next heartbeat (a command was written)
        self.outage = Outage("heartbeat")

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            try:
                await self.beat()
                await self._drain_if_asked()
                await self.trim()
                self.outage.answered()
            except REDIS_ERRORS as exc:
                self.outage.failed(exc)
            await self._rest(stopping)

    async def poke(self, _: str = "") -> None:
        """Beat now: a record this worker follows was written (genq:control names it)."""
        self.now.set()

    async def _rest(self, stopping: asyncio.Event) -> None:
        """Until the next beat: the heartbeat's interval, or less where a command was written
        (`poke`) or the engine made one (the publisher's `made`), or until the stop."""
        events = (stopping, self.now, self.publisher.made)
        waits = [asyncio.ensure_future(event.wait()) for event in events]
        try:
            await asyncio.wait(waits, timeout=self.config.heartbeat_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        self.now.clear()
        self.publisher.made.clear()

    async def beat(self) -> None:
        """One beat: abort jobs past their deadline, write the worker hash, keep in-flight
        entries owned, and act on lost entries and cancel flags."""
        self._abort_expired(time.time())
        if self.config.engine.enable_lora:  # adapters follow the registry, beat by beat
            registry = await read_adapter_registry(self.scripts)
            if registry != self.registry:  # the engine thread hears only of changes
                self.engine.follow_adapters(registry)
                self.registry = registry
        resets = await self.scripts.conn.get(self.scripts.keys.prefix_cache_resets) or b"0"
        if self.resets is not None and resets != self.resets:  # (at start the cache is empty anyway)
            logger.info("worker %s empties its prefix cache, as asked", self.config.name)
            self.engine.reset_prefix_cache()
        self.resets = resets
        update = await read_weights_update(self.scripts, self.config.model_name)
        if update is not None and update.count != self.engine.weights_asked:
            logger.info("worker %s serves the weights of %s from update %d on (%s)", self.config.name,
                        update.model_path, update.count, update.mode)
            self.engine.follow_weights(update)
        command = await read_sleep_command(self.scripts, self.config.model_name)
        if command is not None and command.count != self.engine.sleep_asked:
            logger.info("worker %s %s, as asked (command %d)", self.config.name,
                        f"sleeps (level {command.level})" if command.level else f"wakes {','.join(command.tags)}",
                        command.count)
            self.engine.follow_sleep(command)
        await self._follow_pause()
        held = [h for h in self.table if h.state.writes]
        lost, cancelled = await self.scripts.heartbeat(
            self.scripts.keys.worker(self.config.name),
            encode_worker_info(self.info()),
            [(h.id, h.entry_id) for h in held],
            self.ttl_s,
        )
        await self.scripts.advertise(sorted(self.config.base_names | self.engine.adapters.served.keys()), self.ttl_s)
        for h in held:
            if h.entry_id in lost:
                self.publisher.drop(h, JobState.LOST)
            elif h.entry_id in cancelled:
                self.abort(h, ABORT_CANCELLED)

    async def _follow_pause(self) -> None:
        """Follow a new pause or resume; a pause with mode "abort" ends the running jobs now
        (finish_reason abort, the tokens they wrote kept), as vLLM's does."""
        command = await read_pause_command(self.scripts, self.config.model_name)
        if command is None or command.count == self.engine.pause_asked.count:
            return
        logger.info("worker %s %s, as asked (command %d)", self.config.name,
                    f"pauses (mode {command.mode})" if command.paused else "resumes", command.count)
        self.engine.follow_pause(command)
        if command.paused and command.mode == "abort":
            for held in self.table:
                if held.state == JobState.RUNNING:
                    self.abort(held, ABORT_PAUSED)

    async def _drain_if_asked(self) -> None:
        """Stop as SIGTERM does when `genq drain` asked this process to (the flag names its
        host and pid: one left for a worker of this name that is gone is dropped)."""
        asked = await self.scripts.conn.getdel(self.scripts.keys.drain(self.config.name))
        if self.state != "serving" or asked is None:
            return
        if as_text(asked) != f"{self.host}:{os.getpid()}":
            logger.warning("dropped a request to drain worker %s addressed to %s", self.config.name, as_text(asked))
            return
        logger.info("worker %s asked to drain (genq drain)", self.config.name)
        self.drain()

    async def trim(self) -> None:
        """Drop done entries past their retention from the requests (each shard's lanes) and dead streams, which
        would otherwise grow forever. Any worker may do it: it is idempotent."""
        for stream, retention_s in (
            *((lane, self.config.requests_retention_s) for keys in self.scripts.keys.every_shard
              for lane in keys.lane_streams),
            *((keys.dead, self.config.dead_retention_s) for keys in self.scripts.keys.every_shard),
        ):
            try:
                removed = await self.scripts.trim(stream, retention_s)
            except redis.ResponseError as exc:  # a server without XTRIM MINID (< 6.2), say
                logger.warning("trimming %s failed: %s", stream, exc)
                return
            if removed:
                logger.debug("trimmed %d entries from %s", removed, stream)

    def _abort_expired(self, now: float) -> None:
        for h in self.table:
            if h.state.writes and h.abort_reason is None and h.past_deadline(now):
                self.abort(h, ABORT_DEADLINE)

    def info(self) -> WorkerInfo:
        stats, m, adapters = self.publisher.stats, self.metrics, self.engine.adapters
        made = self.publisher.commands
        return WorkerInfo(
            model=self.config.model_name,
            aliases=",".join(self.config.aliases),
            max_num_seqs=self.engine.engine.max_num_seqs,  # as the engine resolved it
            queue=self.config.queue,
            lora_modules=",".join(adapters.served),
            lora_errors=json.dumps(adapters.errors) if adapters.errors else "",
            max_loras=self.config.engine.max_loras if self.config.engine.enable_lora else 0,
            max_model_len=self.engine.engine.max_model_len,  # as the engine resolved it
            sampling_defaults=json.dumps(self.engine.engine.sampling_defaults) if self.engine.engine.sampling_defaults else "",
            state=self.state,
            running=stats.num_running,
            waiting=stats.num_waiting,
            free_slots=self.capacity(),
            kv_cache_usage=round(stats.kv_cache_usage, 4),
            tokens_per_s=round(m.tokens_per_s(), 2),
            generation_tokens_total=m.generation_tokens_total,
            prompt_tokens_total=m.prompt_tokens_total,
            requests_finished_total=m.requests_finished_total,
            prefix_cache_queries_total=stats.prefix_cache_queries,
            prefix_cache_hits_total=stats.prefix_cache_hits,
            affinity_handoffs_taken_total=m.handoffs_taken_total,
            prefix_cache_resets=int(self.resets or 0),  # (asked of the engine thread before any later job)
            weights_update=made.weights.update,
            weights_path=made.weights.path,
            weights_error=made.weights.error,
            sleep_command=made.sleep.command,
            sleep_level=made.sleep.level,
            pause_command=made.pause.command,
            paused=int(made.pause.paused),
            started_at=self.started_at,
            heartbeat_at=time.time(),
            pid=os.getpid(),
            host=self.host,
        )


async def listen(
    conn: redis.asyncio.Redis, channel: str, on_message: Callable[[str], Awaitable[None]],
    stopping: asyncio.Event, what: str, on_subscribed: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Await `on_message(text)` for each message published on `channel`, resubscribing after
    Redis errors, and `on_subscribed()` each time the subscription is made (what was published
    before it is read some other way then). Whatever a message says is not lost with it:
    cancels are durable flags the heartbeat reads too, handed-over entries idle ones a
    reclaimer takes, commands records the heartbeat reads."""
    outage = Outage(f"{what} listener")
    while not stopping.is_set():
        pubsub = conn.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(channel)
            outage.answered()
            if on_subscribed is not None:
                await on_subscribed()
            while not stopping.is_set():
                message = await unless_set(pubsub.get_message(timeout=CANCEL_POLL_S), stopping)
                if message is not None and message["type"] == "message":
                    data = message["data"]
                    await on_message(data.decode(errors="replace") if isinstance(data, bytes) else str(data))
        except REDIS_ERRORS as exc:
            outage.failed(exc)
            await asyncio.sleep(REDIS_RETRY_S)
        finally:
            await pubsub.aclose()
