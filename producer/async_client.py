"""The asyncio genq client (redis.asyncio): `producer.client.Client`'s API, awaited."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

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
from producer.redis_conn import (
    REDIS_AWAY,
    connect,
    connect_async,
    connect_async_pubsub,
    is_cluster_url,
    pipeline,
)
from producer.shard_pubsub import connect_async_events
from producer.shards import resolve_shards


class AsyncJobHandle:
    """A submitted job of an AsyncClient."""

    def __init__(self, client: AsyncClient, job_id: str, enqueued: bool = False) -> None:
        self.client = client
        self.id = job_id
        self.enqueued = enqueued

    def stream(self, timeout_s: float | None = None) -> AsyncIterator[Delta]:
        return self.client.stream(self.id, timeout_s)

    async def result(self, timeout_s: float | None = None) -> JobResult:
        return await self.client.result(self.id, timeout_s)

    async def cancel(self) -> None:
        await self.client.cancel(self.id)

    async def status(self) -> JobStatus:
        return await self.client.status(self.id)

    def __repr__(self) -> str:
        return f"AsyncJobHandle({self.id!r})"


class AsyncClient:
    """asyncio genq client (redis.asyncio); see `Client` for the meaning of each method."""

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, prefix: str = DEFAULT_PREFIX,
                 shards: int | None = None) -> None:
        """`shards`: as Client's. On a Redis Cluster the number is settled here, with one
        blocking round trip (before any job can use it)."""
        keys = Keys(prefix, cluster=is_cluster_url(redis_url))
        if keys.cluster:
            with connect(redis_url) as conn:
                keys = resolve_shards(conn, keys, shards)
        else:
            keys = resolve_shards(None, keys, shards)
        self.keys = keys
        self.redis = connect_async(redis_url)
        # (the same client off a cluster; on one, a connection that can SUBSCRIBE)
        self.pubsub_redis = connect_async_pubsub(redis_url, self.redis)
        # what jobs' events are followed on: shard channels on a Redis 7 cluster
        self.events_redis = (connect_async_events(redis_url, self.redis, sharded=True)
                             if keys.sharded_pubsub else self.pubsub_redis)  # (the same connections elsewhere)
        self._submit_script = self.redis.register_script(SUBMIT_LUA)
        self.routes = Routes(self.keys)

    async def aclose(self) -> None:
        await self.redis.aclose()
        if self.pubsub_redis is not self.redis:
            await self.pubsub_redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def submit(
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
    ) -> AsyncJobHandle:
        job = build_job(prompt, sampling_params, priority, job_id, deadline_s, model, pooling_params, tenant,
                        return_prompt_token_ids)
        keys, args = submit_call(await self.keys_for(job.model), job)
        entry_id = await self._submit_script(keys=keys, args=args)
        return AsyncJobHandle(self, job.id, enqueued=entry_id is not None)

    async def keys_for(self, model: str | None) -> Keys:
        """The keys to submit a job for `model` under: the stream of the queue whose workers
        serve it (see Routes); no model named: the shared stream."""
        if model is None:
            return self.keys
        known = self.routes.cached(model)
        if known is not None:
            return known
        return self.routes.learn(model, await self.redis.get(self.keys.route(model)))

    def job(self, job_id: str) -> AsyncJobHandle:
        return AsyncJobHandle(self, job_id)

    async def status(self, job_id: str) -> JobStatus:
        value = await self.redis.hget(self.keys.job(job_id), "status")
        if value is None:
            raise JobNotFound(job_id)
        return decode_record({b"status": value}, job_id).status or JobStatus.QUEUED

    async def cancel(self, job_id: str) -> None:
        if self.keys.cluster:  # (see Client.cancel; the asyncio cluster client has no PUBLISH)
            await self.redis.set(self.keys.cancel_flag(job_id), b"1", ex=CANCEL_FLAG_TTL_S)
            await self.pubsub_redis.publish(self.keys.cancel_channel, job_id)
            return
        pipe = pipeline(self.redis)
        pipe.set(self.keys.cancel_flag(job_id), b"1", ex=CANCEL_FLAG_TTL_S)
        pipe.publish(self.keys.cancel_channel, job_id)
        await pipe.execute()

    async def stream(self, job_id: str, timeout_s: float | None = None) -> AsyncIterator[Delta]:
        async for _, event in self._follow({job_id: EventLog(job_id)}, timeout_s):
            if event.error is not None:
                raise JobFailed(job_id, event.error, error_type=event.error_type)
            yield Delta.from_event(event)

    async def result(self, job_id: str, timeout_s: float | None = None) -> JobResult:
        raw = await self.redis.hgetall(self.keys.job(job_id))
        if is_final(raw, job_id):
            return raise_if_failed(make_result(job_id, raw, None))
        log = EventLog(job_id)
        async for _ in self._follow({job_id: log}, timeout_s):
            pass
        raw = await self.redis.hgetall(self.keys.job(job_id))
        return raise_if_failed(make_result(job_id, raw, log))

    async def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: ParamsInput | Sequence[ParamsInput] = None,
        use_tqdm: bool = True,
        timeout_s: float | None = None,
        model: str | None = None,
    ) -> list[JobResult]:
        jobs = batch_jobs(prompts, sampling_params, model)
        submit_keys = await self.keys_for(model)
        # (a cluster pipeline takes no EVALSHA in redis-py: there, a call per job, in order)
        pipe = None if self.keys.cluster else self.redis.pipeline(transaction=False)
        for job in jobs:
            keys, args = submit_call(submit_keys, job)
            await self._submit_script(keys=keys, args=args, client=pipe)
        if pipe is not None:
            await pipe.execute()
        logs = {job.id: EventLog(job.id) for job in jobs}
        with tqdm(total=len(jobs), disable=not use_tqdm, unit="job", desc="genq") as bar:
            async for job_id, _ in self._follow(logs, timeout_s):
                bar.update(int(logs[job_id].done))
            bar.update(len(jobs) - bar.n)
        pipe = self.redis.pipeline(transaction=False)
        for job_id in logs:
            pipe.hgetall(self.keys.job(job_id))
        return [make_result(j, raw, logs[j]) for j, raw in zip(logs, await pipe.execute(), strict=True)]

    async def inspect(self, job_id: str) -> dict[str, Any]:
        pipe = pipeline(self.redis)
        pipe.hgetall(self.keys.job(job_id))
        pipe.xrange(self.keys.events(job_id))
        pipe.exists(self.keys.cancel_flag(job_id))
        raw, events, cancel = await pipe.execute()
        at = entry_location(self.keys, raw)
        entry = await self.redis.xrange(at[0], at[1], at[1]) if at else []
        return inspect_view(job_id, raw, entry, events, bool(cancel))

    async def _follow(
        self, logs: dict[str, EventLog], timeout_s: float | None
    ) -> AsyncIterator[tuple[str, Event]]:
        deadline = Deadline(timeout_s, f"job {next(iter(logs))}" if len(logs) == 1 else "batch")
        follower = Follower(self.keys, logs)
        outage = Outage()
        pubsub, held = await self._subscribed(list(follower.by_channel), outage, deadline)
        try:
            await self._on_subscribed(list(logs))
            async for item in self._replay(follower, list(logs), outage, deadline):
                yield item
            while not follower.done:
                try:
                    message = (
                        held.pop(0) if held
                        else await pubsub.get_message(timeout=deadline.remaining())
                    )
                except REDIS_AWAY as exc:
                    await asyncio.sleep(deadline.cap(outage.failed(exc)))
                    deadline.check()
                    if self.keys.cluster:  # its node may be gone for good (a failover): subscribe anew
                        await pubsub.aclose()
                        pubsub, held = await self._subscribed(list(follower.by_channel), outage, deadline)
                        async for item in self._replay(follower, list(logs), outage, deadline):
                            yield item
                    continue  # the next read reconnects and re-subscribes; see `resubscribed`
                outage.ok()
                if message is None:
                    deadline.check()
                elif (job_id := follower.resubscribed(message)) is not None:
                    async for item in self._replay(follower, [job_id], outage, deadline):
                        yield item
                else:
                    if (job_id := follower.skipped(message)) is not None:  # (its stream has the one missed)
                        async for item in self._replay(follower, [job_id], outage, deadline):
                            yield item
                    for item in follower.message(message):
                        yield item
        finally:
            await pubsub.aclose()

    async def _subscribed(
        self, channels: list[bytes], outage: Outage, deadline: Deadline
    ) -> tuple[Any, list[dict[str, Any]]]:
        """See Client._subscribed."""
        while True:
            pubsub = self.events_redis.pubsub()
            try:
                held = await self._subscribe(pubsub, channels, deadline)
                outage.ok()
                return pubsub, held
            except REDIS_AWAY as exc:
                await pubsub.aclose()
                await asyncio.sleep(deadline.cap(outage.failed(exc)))
                deadline.check()

    async def _subscribe(
        self, pubsub: Any, channels: list[bytes], deadline: Deadline
    ) -> list[dict[str, Any]]:
        for start in range(0, len(channels), SUBSCRIBE_CHUNK):
            await pubsub.subscribe(*channels[start : start + SUBSCRIBE_CHUNK])
        held, confirmed = [], 0
        while confirmed < len(channels):
            message = await pubsub.get_message(timeout=deadline.remaining())
            if message is None:
                deadline.check()
            elif message["type"] == "subscribe":
                confirmed += 1
            else:
                held.append(message)
        return held

    async def _on_subscribed(self, job_ids: list[str]) -> None:
        """Runs between SUBSCRIBE and XRANGE; a test overrides it to write events there."""

    async def _replay(
        self, follower: Follower, job_ids: list[str], outage: Outage, deadline: Deadline
    ) -> AsyncIterator[tuple[str, Event]]:
        while True:
            pipe = pipeline(self.redis)
            for job_id in job_ids:
                pipe.hgetall(self.keys.job(job_id))
                pipe.xrange(self.keys.events(job_id))
            try:
                replies = await pipe.execute()
                break
            except REDIS_AWAY as exc:
                await asyncio.sleep(deadline.cap(outage.failed(exc)))
                deadline.check()
        for i, job_id in enumerate(job_ids):
            for event in follower.replay(job_id, replies[2 * i], replies[2 * i + 1]):
                yield job_id, event
