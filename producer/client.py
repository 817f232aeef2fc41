"""The blocking genq client (redis-py): submit generation jobs to Redis and follow them to
their result. `producer.async_client.AsyncClient` has the same API, awaited; what the two
share is in `producer.jobs`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, cast

from tqdm import tqdm

from producer.jobs import (
    DEFAULT_REDIS_URL,
    SUBMIT_LUA,
    SUBSCRIBE_CHUNK,
    Deadline,
    Delta,
    EventLog,
    Follower,
    JobFailed,
    JobNotFound,
    JobResult,
    Outage,
    ParamsInput,
    PromptInput,
    Routes,
    batch_jobs,
    build_job,
    entry_location,
    inspect_view,
    is_final,
    make_result,
    raise_if_failed,
    submit_call,
)
from producer.pooling_params import PoolingParams
from producer.protocol import CANCEL_FLAG_TTL_S, DEFAULT_PREFIX, Event, JobStatus, Keys
from producer.records import decode_record
from producer.redis_conn import REDIS_AWAY, connect, is_cluster_url, pipeline
from producer.shard_pubsub import ShardPubSub
from producer.shards import resolve_shards


class JobHandle:
    """A submitted job. `enqueued` is False when the id already existed (idempotent submit)."""

    def __init__(self, client: Client, job_id: str, enqueued: bool = False) -> None:
        self.client = client
        self.id = job_id
        self.enqueued = enqueued

    def stream(self, timeout_s: float | None = None) -> Iterator[Delta]:
        return self.client.stream(self.id, timeout_s)

    def result(self, timeout_s: float | None = None) -> JobResult:
        return self.client.result(self.id, timeout_s)

    def cancel(self) -> None:
        self.client.cancel(self.id)

    def status(self) -> JobStatus:
        return self.client.status(self.id)

    def __repr__(self) -> str:
        return f"JobHandle({self.id!r})"


class Client:
    """Blocking genq client (redis-py)."""

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, prefix: str = DEFAULT_PREFIX,
                 shards: int | None = None) -> None:
        """`shards`: request-stream shards on a Redis Cluster; None: the number the cluster
        records (producer.shards), which another number here must equal."""
        self.url = redis_url
        self.redis = connect(redis_url)
        self.keys = resolve_shards(self.redis, Keys(prefix, cluster=is_cluster_url(redis_url)), shards)
        self._submit_script = self.redis.register_script(SUBMIT_LUA)
        self.routes = Routes(self.keys)

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(
        self,
        prompt: PromptInput,
        sampling_params: ParamsInput = None,
        priority: int = 0,
        job_id: str | None = None,
        deadline_s: float | None = None,
        model: str | None = None,
        pooling_params: PoolingParams | None = None,
        tenant: str | None = None,
        return_prompt_token_ids: bool = False,
    ) -> JobHandle:
        """Enqueue one job (once per job id); raises ValueError on invalid input. With
        `pooling_params` it is an embedding job (`result().embedding`); `tenant` names who
        its tokens are metered to (`usage`); with `return_prompt_token_ids` each completion's
        first event carries the prompt's token ids as the worker ran it."""
        job = build_job(prompt, sampling_params, priority, job_id, deadline_s, model, pooling_params, tenant,
                        return_prompt_token_ids)
        keys, args = submit_call(self.keys_for(job.model), job)
        entry_id = self._submit_script(keys=keys, args=args)
        return JobHandle(self, job.id, enqueued=entry_id is not None)

    def keys_for(self, model: str | None) -> Keys:
        """The keys to submit a job for `model` under: the stream of the queue whose workers
        serve it (see Routes); no model named: the shared stream."""
        if model is None:
            return self.keys
        known = self.routes.cached(model)
        if known is not None:
            return known
        return self.routes.learn(model, cast(bytes | None, self.redis.get(self.keys.route(model))))

    def job(self, job_id: str) -> JobHandle:
        """A handle on an existing job."""
        return JobHandle(self, job_id)

    def status(self, job_id: str) -> JobStatus:
        value = self.redis.hget(self.keys.job(job_id), "status")
        if value is None:
            raise JobNotFound(job_id)
        return decode_record({b"status": value}, job_id).status or JobStatus.QUEUED

    def cancel(self, job_id: str) -> None:
        """Ask workers to abort the job. The flag is durable: a worker taking the job from the
        queue later, or reclaiming it after a crash, checks it. The PUBLISH is prompt: the
        worker running it aborts at its next step. Flag first, in one MULTI, so a worker woken
        by the message always finds the flag too (on a Redis Cluster, whose pipelines take no
        PUBLISH: the SET answered, then the PUBLISH)."""
        if self.keys.cluster:
            self.redis.set(self.keys.cancel_flag(job_id), b"1", ex=CANCEL_FLAG_TTL_S)
            self.redis.publish(self.keys.cancel_channel, job_id)
            return
        pipe = pipeline(self.redis)
        pipe.set(self.keys.cancel_flag(job_id), b"1", ex=CANCEL_FLAG_TTL_S)
        pipe.publish(self.keys.cancel_channel, job_id)
        pipe.execute()

    def stream(self, job_id: str, timeout_s: float | None = None) -> Iterator[Delta]:
        """Every new output of the job, in order, exactly once; raises JobFailed at an error
        event and TimeoutError when `timeout_s` passes before the job ends."""
        for _, event in self._follow({job_id: EventLog(job_id)}, timeout_s):
            if event.error is not None:
                raise JobFailed(job_id, event.error, error_type=event.error_type)
            yield Delta.from_event(event)

    def result(self, job_id: str, timeout_s: float | None = None) -> JobResult:
        """Wait for the job to end (TimeoutError after `timeout_s`); raises JobFailed."""
        raw = self._hgetall(self.keys.job(job_id))
        if is_final(raw, job_id):
            return raise_if_failed(make_result(job_id, raw, None))
        log = EventLog(job_id)
        for _ in self._follow({job_id: log}, timeout_s):
            pass
        raw = self._hgetall(self.keys.job(job_id))
        return raise_if_failed(make_result(job_id, raw, log))

    def _hgetall(self, key: str) -> dict[bytes, bytes]:
        return cast(dict[bytes, bytes], self.redis.hgetall(key))

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: ParamsInput | Sequence[ParamsInput] = None,
        use_tqdm: bool = True,
        timeout_s: float | None = None,
        model: str | None = None,
    ) -> list[JobResult]:
        """Submit a batch in one pipeline, wait for all, return results in input order."""
        jobs = batch_jobs(prompts, sampling_params, model)
        submit_keys = self.keys_for(model)
        # (a cluster pipeline takes no EVALSHA in redis-py: there, a call per job, in order)
        pipe = None if self.keys.cluster else self.redis.pipeline(transaction=False)
        for job in jobs:
            keys, args = submit_call(submit_keys, job)
            self._submit_script(keys=keys, args=args, client=pipe)
        if pipe is not None:
            pipe.execute()
        logs = {job.id: EventLog(job.id) for job in jobs}
        with tqdm(total=len(jobs), disable=not use_tqdm, unit="job", desc="genq") as bar:
            for job_id, _ in self._follow(logs, timeout_s):
                bar.update(int(logs[job_id].done))
            bar.update(len(jobs) - bar.n)
        return self._results(logs)

    def inspect(self, job_id: str) -> dict[str, Any]:
        """The decoded job record, payload and events (what `genq inspect` prints)."""
        pipe = pipeline(self.redis)
        pipe.hgetall(self.keys.job(job_id))
        pipe.xrange(self.keys.events(job_id))
        pipe.exists(self.keys.cancel_flag(job_id))
        raw, events, cancel = pipe.execute()
        at = entry_location(self.keys, raw)
        entry = self.redis.xrange(at[0], at[1], at[1]) if at else []
        return inspect_view(job_id, raw, cast(list[Any], entry), events, bool(cancel))

    def _results(self, logs: dict[str, EventLog]) -> list[JobResult]:
        pipe = self.redis.pipeline(transaction=False)
        for job_id in logs:
            pipe.hgetall(self.keys.job(job_id))
        return [make_result(j, raw, logs[j]) for j, raw in zip(logs, pipe.execute(), strict=True)]

    def _follow(
        self, logs: dict[str, EventLog], timeout_s: float | None
    ) -> Iterator[tuple[str, Event]]:
        """New events of these jobs until all have ended (see `Follower`)."""
        deadline = Deadline(timeout_s, f"job {next(iter(logs))}" if len(logs) == 1 else "batch")
        follower = Follower(self.keys, logs)
        outage = Outage()
        pubsub, held = self._subscribed(list(follower.by_channel), outage, deadline)
        try:
            self._on_subscribed(list(logs))
            yield from self._replay(follower, list(logs), outage, deadline)
            while not follower.done:
                try:
                    message = held.pop(0) if held else pubsub.get_message(timeout=deadline.remaining())
                except REDIS_AWAY as exc:
                    time.sleep(deadline.cap(outage.failed(exc)))
                    deadline.check()
                    if self.keys.cluster:  # its node may be gone for good (a failover): subscribe anew
                        pubsub.close()
                        pubsub, held = self._subscribed(list(follower.by_channel), outage, deadline)
                        yield from self._replay(follower, list(logs), outage, deadline)
                    continue  # the next read reconnects and re-subscribes; see `resubscribed`
                outage.ok()
                if message is None:
                    deadline.check()
                elif (job_id := follower.resubscribed(message)) is not None:
                    yield from self._replay(follower, [job_id], outage, deadline)
                else:
                    if (job_id := follower.skipped(message)) is not None:  # (its stream has the one missed)
                        yield from self._replay(follower, [job_id], outage, deadline)
                    yield from follower.message(message)
        finally:
            pubsub.close()

    def _subscribed(
        self, channels: list[bytes], outage: Outage, deadline: Deadline
    ) -> tuple[Any, list[dict[str, Any]]]:
        """A pub/sub connection with every channel confirmed (and the messages that came
        meanwhile), made again while Redis is away: a stream begun just before an outage
        waits for Redis as one under way does."""
        while True:
            pubsub = self._new_pubsub()
            try:
                held = self._subscribe(pubsub, channels, deadline)
                outage.ok()
                return pubsub, held
            except REDIS_AWAY as exc:
                pubsub.close()
                time.sleep(deadline.cap(outage.failed(exc)))
                deadline.check()

    def _new_pubsub(self) -> Any:
        """A pub/sub connection; on a Redis 7 cluster, on the nodes of the channels' slots
        (shard channels); on an older one, to a random node (each relays every PUBLISH), so
        that one made again after its node was lost goes elsewhere."""
        if self.keys.sharded_pubsub:
            return ShardPubSub(self.redis, self.url)
        if self.keys.cluster:
            return self.redis.pubsub(node=self.redis.get_random_node())
        return self.redis.pubsub()

    def _subscribe(
        self, pubsub: Any, channels: list[bytes], deadline: Deadline
    ) -> list[dict[str, Any]]:
        """SUBSCRIBE and wait for every confirmation: the XRANGE runs on another connection, so
        only a confirmed subscription guarantees that nothing published after it is missed."""
        for start in range(0, len(channels), SUBSCRIBE_CHUNK):
            pubsub.subscribe(*channels[start : start + SUBSCRIBE_CHUNK])
        held, confirmed = [], 0
        while confirmed < len(channels):
            message = pubsub.get_message(timeout=deadline.remaining())
            if message is None:
                deadline.check()
            elif message["type"] == "subscribe":
                confirmed += 1
            else:
                held.append(message)
        return held

    def _on_subscribed(self, job_ids: list[str]) -> None:
        """Runs between SUBSCRIBE and XRANGE; a test overrides it to write events there."""

    def _replay(
        self, follower: Follower, job_ids: list[str], outage: Outage, deadline: Deadline
    ) -> Iterator[tuple[str, Event]]:
        """Each job's record and events in one MULTI, tried again while Redis is away (the
        subscription stands, or its reconnect asks for another replay)."""
        while True:
            pipe = pipeline(self.redis)
            for job_id in job_ids:
                pipe.hgetall(self.keys.job(job_id))
                pipe.xrange(self.keys.events(job_id))
            try:
                replies = pipe.execute()
                break
            except REDIS_AWAY as exc:
                time.sleep(deadline.cap(outage.failed(exc)))
                deadline.check()
        for i, job_id in enumerate(job_ids):
            for event in follower.replay(job_id, replies[2 * i], replies[2 * i + 1]):
                yield job_id, event
