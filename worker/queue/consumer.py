"""The Redis consumer, hosted by arq: `arq worker.WorkerSettings` (or `genq worker`).

arq provides the process: its event loop, signal handling and health check
(`arq --check worker.WorkerSettings`). `on_startup` loads the engine and starts the
consumer; the consumer's own asyncio tasks do the work:

- intake: XREADGROUP as many new jobs as the engine has room for;
- publisher: engine step results -> one STEP_LUA call per batch of steps;
- heartbeat: the worker hash, re-owning in-flight entries, cancel flags, deadlines;
- reclaimer: entries of dead workers, resumed from the tokens they had sent;
- cancel listener: the `cancel` channel;
- control listener: the `control` channel (a command record was written: beat now);
- handoff listener: entries other workers handed to this one (affinity).

The engine steps in its own thread (`engine_thread.EngineThread`). On SIGTERM arq cancels
its main task and calls `on_shutdown`, which drains: intake stops, jobs that have produced
nothing yet are released at once, the others get `shutdown_grace_s` to finish, what is left
is released (claimable by another worker at once), and the worker hash is deleted.

arq's own job queue is not used; `ping` is there because arq needs one function.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import redis
import redis.asyncio
from arq.connections import RedisSettings

from producer.aio import wait_for_event, wait_within
from producer.protocol import Keys
from producer.redis_conn import connect_async, connect_async_pubsub, plain_url
from producer.shards import resolve_shards_async
from producer.trace_log import open_trace
from producer.tracing import Tracing
from worker.queue.config import WorkerConfig, config_from_env
from worker.queue.engine_thread import EngineThread, Rejected, intake_capacity
from worker.queue.heartbeat import (
    Heartbeat,
    listen,
    read_adapter_registry,
    read_pause_command,
    read_sleep_command,
    read_weights_update,
)
from worker.queue.intake import INTAKE_BLOCK_S, Admission, Intake, Reclaimer
from worker.queue.jobs import ABORT_CANCELLED, HeldJob, JobState, JobTable
from worker.queue.metrics import WorkerMetrics
from worker.queue.outage import CONNECT_TIMEOUT_S, REDIS_ERRORS, Outage, PatientPool, patient_pool
from worker.queue.publisher import Publisher
from worker.queue.scripts import NameTaken, Scripts
from worker.queue.tokenizer import publish_tokenizer

logger = logging.getLogger(__name__)

ARQ_POLL_DELAY_S = 1.0  # arq's loop: polls its (empty) queue and writes the health-check key
# The engine thread releases the GIL in every torch op; while the event loop is busy publishing,
# each re-acquire waits up to the switch interval (5 ms by default), many times per step. At
# 0.5 ms the engine keeps its pace: on an H200, W1 at 512 prompts went from 80% of the
# in-process engine's throughput to 100%.
GIL_SWITCH_INTERVAL_S = 0.0005
NAME_WAIT_S = 5.0  # extra wait, past the heartbeat TTL, for a namesake worker to expire
FLUSH_TIMEOUT_S = 10.0  # shutdown: longest wait for the last results to be published


class QueueTaken(RuntimeError):
    """Live workers of another model read the stream this worker was told to read."""


class Consumer:
    """Ties the engine thread to Redis. `start()` then `shutdown()`, on one event loop."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.keys = config.keys
        self.table = JobTable()
        self.stop_intake = asyncio.Event()
        self.stop_control = asyncio.Event()
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        self.released: set[str] = set()  # entry ids handed back during the drain
        # a namesake holds the name now: entries pending under it and its heartbeat hash are
        # that worker's too, so the drain touches only this worker's own jobs
        self.name_lost = False

    # -- start ---------------------------------------------------------------------------------

    async def start(self) -> None:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # this process hosts one worker
        self.conn = connect_async(self.config.redis_url, socket_connect_timeout=CONNECT_TIMEOUT_S)
        # (on a Redis Cluster the asyncio client has no pub/sub: plain connections to its nodes)
        self.pubsub_conn = connect_async_pubsub(self.config.redis_url, self.conn, socket_connect_timeout=CONNECT_TIMEOUT_S)
        # (the request-stream shards every process of this prefix uses; another number set here stops the start)
        self.keys = await resolve_shards_async(self.conn, self.config.keys, self.config.redis_shards)
        self.scripts = Scripts(self.conn, self.keys, self.config.name, self.config.events_retention_s)
        await self._check_queue()  # before the model loads: a refusal comes at once
        self.trace = open_trace(self.config.trace_dir, f"worker-{self.config.name}")
        self.engine = EngineThread(self.config.engine, asyncio.get_running_loop(), self.config.lora_requests,
                                   self.config.base_names, self.trace)
        # the runtime adapters are read with the model, before any job can name one
        registry = await read_adapter_registry(self.scripts) if self.config.engine.enable_lora else {}
        # ... and so is the model's latest weights update: a worker that starts after one serves it too
        weights = await read_weights_update(self.scripts, self.config.model_name)
        sleep = await read_sleep_command(self.scripts, self.config.model_name)  # (asleep, it takes no job)
        pause = await read_pause_command(self.scripts, self.config.model_name)  # (paused, nor does it)
        engine = await self.engine.start(registry, weights, sleep, pause)  # loads the model; steps wait for the first command
        _freeze_start()  # (before any job can reach this worker: the last full pass takes a moment)
        endpoint = self.config.otlp_traces_endpoint
        self.tracing = Tracing(endpoint, "genq-worker") if endpoint else None
        self.metrics = WorkerMetrics(self.config.model_name, self.tracing)
        self.publisher = Publisher(
            self.scripts, self.table, self.engine, self.metrics, self.config.name, self._reject,
            self.config.model_name, self.config.stream_interval_ms, self.trace,
            self.config.stream_coalesce_min_tokens_per_s,
        )
        self.admission = Admission(self.config, self.scripts, self.table, self.engine, self.metrics)
        self.heartbeat = Heartbeat(
            self.config, self.scripts, self.table, self.publisher, self.metrics,
            self.capacity, self.abort, self.engine, self._stop,
        )
        await self.scripts.ensure_group()
        # before the first heartbeat shows this worker: whoever sees it can read its tokenizer
        # (and a classifier's labels) at once
        await publish_tokenizer(self.conn, self.keys, self.config.model_name, engine.tokenizer, engine.eos_token_ids,
                                engine.model_config.labels)
        try:
            await self._claim_name()
        except asyncio.CancelledError:  # stopped (SIGTERM) as its first beat went out: no name left behind
            with contextlib.suppress(redis.RedisError):  # (else its TTL ends it)
                await self.scripts.unclaim(self.keys.worker(self.config.name), self.heartbeat.host, os.getpid())
            raise
        if self.config.metrics_port is not None:
            self.metrics.serve(self.config.metrics_port, self.config.metrics_host)
        self._start_tasks()
        logger.info(
            "worker %s serving %s (max_num_seqs=%d, %d KV blocks%s) on %s",
            self.config.name, self.config.model_name, engine.max_num_seqs, engine.block_manager.num_blocks,
            ", async scheduling" if engine.config.async_scheduling else "",
            self.keys.requests + (f" and its {self.keys.shards - 1} other shards" if self.keys.shards > 1 else ""),
        )

    def _start_tasks(self) -> None:
        reclaimer = Reclaimer(self.admission, self.capacity, self.table, self.config)
        intake = Intake(self.admission, self.capacity, self.publisher.changed, lambda: self.engine.takes_jobs)
        self._spawn("publisher", self.publisher.run())
        self._spawn("heartbeat", self.heartbeat.run(self.stop_control))
        self._spawn("cancels", listen(self.pubsub_conn, self.keys.cancel_channel, self.cancel, self.stop_control, "cancel"))
        # (subscribed, it beats: a command written before the subscription is read then)
        self._spawn("control", listen(self.pubsub_conn, self.keys.control_channel, self.heartbeat.poke, self.stop_control,
                                      "control", self.heartbeat.poke))
        self._spawn("intake", _retrying("intake", lambda: intake.run(self.stop_intake), self.stop_intake))
        self._spawn("reclaimer", _retrying("reclaimer", lambda: reclaimer.run(self.stop_intake), self.stop_intake))
        if self.config.cache_affinity:  # (stops with the intake: what comes later, the drain releases)
            self._spawn("handoffs", listen(self.pubsub_conn, self.keys.handoff_channel(self.config.name),
                                           self.admission.take_handed, self.stop_intake, "handoff"))

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro, name=f"genq-{name}")
        task.add_done_callback(self._task_done)
        self.tasks[name] = task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        """A task that dies on its own is fatal: stop the worker the way SIGTERM does, so its
        entries are released and picked up by other workers."""
        if task.cancelled() or task.exception() is None:
            return
        if isinstance(task.exception(), NameTaken):
            self.name_lost = True
        logger.critical("%s failed; stopping the worker", task.get_name(), exc_info=task.exception())
        self._stop()

    @staticmethod
    def _stop() -> None:
        """Stop the worker as SIGTERM does (arq's handler cancels its loop; on_shutdown drains)."""
        os.kill(os.getpid(), signal.SIGTERM)

    async def _check_queue(self) -> None:
        """Refuse to read a stream whose live workers serve another model.

        Race prevented: two models' workers on one stream, each taking the other's jobs and
        forwarding them back to that same stream, round and round."""
        beside = await self.scripts.models_beside(self.config.model_name)
        if beside:
            name, model = sorted(beside.items())[0]
            raise QueueTaken(
                f"{self.keys.requests} is read by worker {name}, serving {model!r}; workers on "
                f"one queue serve one model: start this worker ({self.config.model_name!r}) "
                "with its own --queue NAME (GENQ_QUEUE)"
            )

    async def _claim_name(self) -> None:
        """Refuse to share a consumer name with a live worker.

        Race prevented: two workers under one name both pass every ownership check for each
        other's entries, so both would run them. A namesake that is gone (the same worker
        restarting) disappears within the heartbeat TTL."""
        deadline = time.monotonic() + self.heartbeat.ttl_s + NAME_WAIT_S
        while True:
            try:
                await self.heartbeat.beat()  # the first beat claims the name, or names its holder
                return
            except NameTaken as taken:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"a worker named {self.config.name!r} is alive (host {taken.host}, pid "
                        f"{taken.pid}); give this one another name (GENQ_WORKER_NAME / --name)"
                    ) from None
                logger.warning("worker name %s is in use by pid %d; waiting for it to expire",
                               self.config.name, taken.pid)
            await asyncio.sleep(self.config.heartbeat_s)

    # -- what the tasks share --------------------------------------------------------------

    def capacity(self) -> int:
        """Jobs to take now: see `intake_capacity`; 0 while draining, asleep (sleep mode) or paused."""
        if self.stop_intake.is_set() or not self.engine.takes_jobs:
            return 0
        stats = self.publisher.stats
        in_flight = self.admission.num_admitting + max(
            0, self.admission.num_adds_sent - stats.num_adds_taken
        )
        return intake_capacity(stats, self.engine.engine.max_num_seqs, in_flight)

    def abort(self, held: HeldJob, reason: str) -> None:
        """Ask the engine to end a job now (cancel, deadline); it ends with `abort` events."""
        if held.abort_reason is None:
            held.abort_reason = reason
        if held.state == JobState.RUNNING:
            self.engine.abort(sorted(held.engine_ids))

    async def cancel(self, job_id: str) -> None:
        held = self.table.get(job_id)
        if held is not None and held.state.writes:
            logger.info("job %s: cancel requested", job_id)
            self.abort(held, ABORT_CANCELLED)

    async def _reject(self, held: HeldJob, refused: Rejected) -> None:
        """The engine refused the job (prompt over max_model_len, ...): fail it and
        dead-letter its entry."""
        await self.admission.fail_held(held, refused.error, refused.error_type)
        if not held.engine_ids:
            self.table.remove(held)

    # -- shutdown ------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Drain (see the module docstring); safe to call once, after `start`."""
        logger.info("worker %s draining (grace %.1f s)", self.config.name, self.config.shutdown_grace_s)
        self.heartbeat.state = "draining"
        self.stop_intake.set()
        await self._wait_tasks("intake", "reclaimer", "handoffs", timeout_s=INTAKE_BLOCK_S + 5)
        await self._release([h for h in self.table if h.state.writes and h.last_token_at is None])
        # with the name lost, the namesake may reclaim these jobs any time: hand them over now;
        # with Redis away, nothing they make could be written: no grace either
        no_grace = self.name_lost or self._redis_away()
        await self._wait_for_jobs(0.0 if no_grace else self.config.shutdown_grace_s)
        await self._release([h for h in self.table if h.state.writes])
        await asyncio.to_thread(self.engine.stop, 10.0)
        await self._flush_publisher(0.0 if self._redis_away() else FLUSH_TIMEOUT_S)
        if not self.name_lost:
            await self._release_pending()
        self.stop_control.set()
        await self._wait_tasks("heartbeat", "cancels", timeout_s=5.0)
        if not self.name_lost:
            with self._unless_redis_away("the worker hash expires by itself"):
                await self.conn.delete(self.keys.worker(self.config.name))
        await self.conn.aclose()
        if self.pubsub_conn is not self.conn:
            await self.pubsub_conn.aclose()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # the last jobs' spans go out
        if self.trace is not None:
            self.trace.close()
        logger.info("worker %s stopped", self.config.name)

    async def _release(self, jobs: list[HeldJob]) -> None:
        for held in jobs:
            self.publisher.drop(held, JobState.RELEASED)
        await self._send_held(jobs)
        await self._release_entries([h.entry_id for h in jobs])

    async def _send_held(self, jobs: list[HeldJob]) -> None:
        """The released jobs' held tokens (coalesced events), before their entries go back: the
        worker that resumes a job goes on from its stream, so nothing made here is lost. Tried
        once, not while Redis is away (the next worker makes those tokens again then)."""
        if not any(h.unsent for h in jobs) or self._redis_away():
            return
        try:
            await wait_within(self.publisher.publish_held(time.time(), jobs, retry=False), FLUSH_TIMEOUT_S)
        except (TimeoutError, *REDIS_ERRORS) as exc:
            logger.warning("draining: tokens held for %d jobs not sent (%s); the next worker makes them again",
                           len(jobs), exc)

    async def _release_entries(self, entry_ids: list[str]) -> None:
        if entry_ids:
            with self._unless_redis_away(f"{len(entry_ids)} entries stay pending until another worker reclaims them"):
                released = await self.scripts.release(entry_ids)
                self.released.update(entry_ids)
                logger.info("released %d entries for other workers", released)

    async def _release_pending(self) -> None:
        """What is still pending under this name (read but never admitted, say)."""
        with self._unless_redis_away("what is pending under this name stays so until reclaimed"):
            await self._release_entries([e for e in await self.scripts.own_pending() if e not in self.released])

    def _redis_away(self) -> bool:
        return self.publisher.outage.down_since is not None or self.heartbeat.outage.down_since is not None

    @staticmethod
    @contextlib.contextmanager
    def _unless_redis_away(then: str) -> Iterator[None]:
        """A drain's write, skipped with Redis away: the drain still ends (SIGTERM during an
        outage), and what it would have written, another worker or a TTL sees to."""
        try:
            yield
        except REDIS_ERRORS as exc:
            logger.warning("draining without Redis (%s): %s", exc, then)

    async def _wait_for_jobs(self, timeout_s: float) -> None:
        """Until no job is left running or `timeout_s` passed (or the engine died)."""
        deadline = time.monotonic() + timeout_s
        while self.engine.alive and any(h.state.writes for h in self.table):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.publisher.changed.clear()
            if any(h.state.writes for h in self.table):
                await wait_for_event(self.publisher.changed, min(left, 1.0))

    async def _flush_publisher(self, timeout_s: float) -> None:
        """Publish what the stopped engine thread posted, then stop the publisher (given up
        after `timeout_s`, should Redis be gone: the entries are reclaimed anyway)."""
        task = self.tasks["publisher"]
        deadline = time.monotonic() + timeout_s
        await asyncio.sleep(0)  # run the thread's pending call_soon_threadsafe callbacks
        while not task.done() and not (self.engine.results.empty() and self.publisher.idle.is_set()):
            if time.monotonic() > deadline:
                break
            await wait_for_event(self.publisher.changed, 0.1)
            self.publisher.changed.clear()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def _wait_tasks(self, *names: str, timeout_s: float) -> None:
        tasks = [self.tasks[n] for n in names if n in self.tasks]
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _retrying(what: str, run: Callable[[], Coroutine[Any, Any, None]], stopping: asyncio.Event) -> None:
    """Run a loop again after Redis connection errors (Redis restarted, network blip)."""
    outage = Outage(what)
    while not stopping.is_set():
        try:
            await run()
        except REDIS_ERRORS as exc:
            outage.failed(exc)
            await wait_for_event(stopping, 1.0)


# ---------------------------------------------------------------------------------------------
# arq hooks and settings


async def ping(ctx: dict[str, Any]) -> str:
    """arq needs at least one function; genq's work does not go through arq's queue."""
    return "pong"


async def startup(ctx: dict[str, Any]) -> None:
    """arq `on_startup`: load the engine, start the consumer."""
    _configure_logging()
    pool = ctx.get("redis")
    if isinstance(pool, PatientPool):  # this task is arq's main loop: its pool waits out outages now
        pool.hold_on(asyncio.current_task())  # type: ignore[arg-type]
    consumer = Consumer(ctx["config"])
    await consumer.start()
    ctx["consumer"] = consumer


def _freeze_start() -> None:
    """The start's objects (the model's modules, the tokenizer's tables: some 300k) leave the
    collector's full passes, which a worker's steps set off as they run: each walked them all,
    about 180 ms, 1.4 to 4.6 ms a step at 256 to 512 sequences (benchmarks/step_overhead.py).
    As vLLM's engine core does; they are this worker process's for its whole life."""
    gc.collect()
    gc.freeze()


def _configure_logging() -> None:
    """Show genq's INFO logs unless the host process configured logging itself; arq's CLI
    gives its own logger a handler, so it stops propagating to avoid printing lines twice."""
    if logging.getLogger().handlers:
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    arq_logger = logging.getLogger("arq")
    if arq_logger.handlers:
        arq_logger.propagate = False


async def shutdown(ctx: dict[str, Any]) -> None:
    """arq `on_shutdown` (after SIGTERM/SIGINT): drain and stop the consumer."""
    consumer = ctx.pop("consumer", None)
    if consumer is not None:
        await consumer.shutdown()


def arq_settings(config: WorkerConfig) -> dict[str, Any]:
    """The per-configuration arq arguments (the rest are WorkerSettings' constants)."""
    return {
        "ctx": {"config": config},
        "redis_settings": RedisSettings.from_dsn(plain_url(config.redis_url)),
        "redis_pool": patient_pool(config.redis_url),
        "queue_name": Keys(config.prefix).arq_queue(config.name),
        "health_check_interval": config.heartbeat_s,
    }


class WorkerSettings:
    """`arq worker.WorkerSettings`: configured by GENQ_* variables (docs/queue.md).

    The environment is read here, in the class body, when arq imports the class; nothing
    below reads it again. arq's health-check key is `<prefix>arq:<name>:health-check`, so
    `arq --check worker.WorkerSettings` with the same GENQ_WORKER_NAME checks that worker."""

    config = config_from_env(os.environ)
    functions = [ping]
    on_startup = startup
    on_shutdown = shutdown
    poll_delay = ARQ_POLL_DELAY_S
    max_jobs = 1
    ctx = {"config": config}
    redis_settings = RedisSettings.from_dsn(plain_url(config.redis_url))  # (what `arq --check` reads)
    redis_pool = patient_pool(config.redis_url)  # arq's loop waits out a Redis outage
    queue_name = Keys(config.prefix).arq_queue(config.name)
    health_check_interval = config.heartbeat_s
