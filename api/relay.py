"""One Redis pub/sub connection per API process, fanned out to the requests following jobs.

Each HTTP request that follows jobs gets an asyncio queue; the relay subscribes to a job's
channel when the first follower arrives and unsubscribes when the last one leaves. One
listener task reads the shared connection and puts each message on the queues of that channel.

A follow is lossless, as in `producer.client`: SUBSCRIBE and wait for Redis to confirm it, then
read the job record and XRANGE the events in one MULTI, then take the queue. The worker writes
each event with XADD and PUBLISH in one Lua call, so every event is in the replay, on the queue,
or both; `JobEvents` drops the doubles by (index, seq).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, field
from typing import Any

import anyio
import redis
import redis.asyncio

from producer.aio import wait_within
from producer.jobs import JobLost, JobNotFound, Outage, record_ending, skips_a_seq
from producer.protocol import EVENT_FIELD, Event, Keys, decode_event
from producer.records import JobRecord, decode_record
from producer.redis_conn import REDIS_AWAY, pipeline

log = logging.getLogger(__name__)

RECONNECT_BACKOFF_S = 0.5  # between attempts to reach Redis again after the link broke
RESYNC = None  # queue item data: the channel was subscribed again after a reconnect

QueueItem = tuple[bytes, bytes | None]  # (channel, message data or RESYNC)


class JobEvents:
    """One job's events as a follower sees them: repeats dropped, the end recognised.

    `resume` is the (index, seq) of the last event a client already has (SSE Last-Event-ID):
    the first replay skips every event up to and including it, in stream order.
    """

    def __init__(self, job_id: str, resume: tuple[int, int] | None = None) -> None:
        self.job_id = job_id
        self.n: int | None = None  # completions to expect, from the job record
        self.record: JobRecord | None = None  # as read by the last replay
        self.closed = False  # the record is terminal yet final events are gone (expired)
        self.error: str | None = None
        self._resume = resume
        self._last_seq: dict[int, int] = {}
        self._sent: dict[int, tuple[int, int]] = {}  # (characters, tokens) followed, per index
        self._finished: set[int] = set()
        self.sparse = False  # a replay found the stream's seqs skipping: no gap is a lost message

    @property
    def done(self) -> bool:
        if self.closed or self.error is not None:
            return True
        return self.n is not None and all(i in self._finished for i in range(self.n))

    def add(self, event: Event) -> bool:
        """True for an event not seen yet; False for a repeat or one after the end."""
        last = self._last_seq.get(event.index)
        if self.done or (last is not None and event.seq <= last):
            return False
        self._mark(event)
        return True

    def skips(self, event: Event) -> bool:
        """Whether a channel message's event comes after one of its completion's not seen: the
        channel lost one (a Redis node died having stored and replicated it, not relayed it)."""
        return not self.sparse and event.seq > self._last_seq.get(event.index, -1) + 1

    def _mark(self, event: Event) -> None:
        self._last_seq[event.index] = max(event.seq, self._last_seq.get(event.index, -1))
        chars, tokens = self._sent.get(event.index, (0, 0))
        self._sent[event.index] = (chars + len(event.text), tokens + len(event.token_ids))
        if event.error is not None:
            self.error = event.error
        elif event.finished:
            self._finished.add(event.index)

    def replay(self, raw_record: dict[Any, Any], entries: list[Any]) -> list[Event]:
        """The new events of a replay (HGETALL of the record, XRANGE of the events)."""
        if not raw_record:  # (a first replay: never submitted or expired; a later one: lost)
            raise JobNotFound(self.job_id) if self.n is None else JobLost(self.job_id)
        self.record = decode_record(raw_record, self.job_id)
        self.n = self.record.n or 1
        events = [_entry_event(fields) for _, fields in entries]
        self.sparse = self.sparse or skips_a_seq(events)
        if self._resume is not None:
            events = self._skip_resumed(events, *self._resume)
            self._resume = None
        new = [event for event in events if self.add(event)]
        # Terminal before the XRANGE, yet some final events are missing: they expired, and
        # nothing more will come on the channel. The record has the rest.
        if self.record.status is not None and self.record.status.terminal and not self.done:
            ending = record_ending(self.record, self._last_seq, self._finished, self._sent)
            new += [event for event in ending if self.add(event)]
            self.closed = not self.done
        return new

    def _skip_resumed(self, events: list[Event], index: int, seq: int) -> list[Event]:
        self._last_seq[index] = seq
        position = next(
            (i for i, e in enumerate(events) if (e.index, e.seq) == (index, seq)), None
        )
        if position is None:  # not in the log (expired): skip by seq for that index only
            return events
        for event in events[: position + 1]:
            self._mark(event)
        return events[position + 1 :]


def _entry_event(entry_fields: dict[bytes, bytes]) -> Event:
    return decode_event(entry_fields.get(EVENT_FIELD.encode(), b""))


@dataclass
class _Channel:
    queues: set[asyncio.Queue[QueueItem]] = field(default_factory=set)
    confirmed: asyncio.Event = field(default_factory=asyncio.Event)


class Relay:
    """`async for job_id, event in relay.follow([job_id]): ...` over one shared PubSub.

    Channel state changes and the SUBSCRIBE / UNSUBSCRIBE they send happen under one lock, so
    the commands reach Redis in the order of the state changes. A channel is unsubscribed only
    once its subscription is confirmed, so a confirmation always belongs to the latest
    SUBSCRIBE; any other "subscribe" message comes from redis-py re-subscribing after a
    reconnect, and tells the followers of that channel to replay (the gap is in the stream).
    """

    def __init__(self, conn: redis.asyncio.Redis, keys: Keys, pubsub_conn: redis.asyncio.Redis | None = None) -> None:
        self._redis = conn
        self._keys = keys
        # on a Redis Cluster, plain connections to its nodes (AsyncClient.pubsub_redis), and
        # after a lost connection a new one elsewhere: its node may be gone for good
        self._source = pubsub_conn or conn
        self._elsewhere = self._source is not conn
        self._pubsub = self._source.pubsub()
        self._fresh = False  # a pub/sub made elsewhere, not yet given the channels
        self._channels: dict[bytes, _Channel] = {}
        self._lock = asyncio.Lock()
        self._connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._listen(), name="genq-relay")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._pubsub.aclose()

    @property
    def num_channels(self) -> int:
        return len(self._channels)

    async def follow(
        self,
        job_ids: list[str],
        resume: tuple[int, int] | None = None,
        timeout_s: float | None = None,
    ) -> AsyncGenerator[tuple[str, Event], None]:
        """Every new event of these jobs, in order, until all have ended, across Redis outages
        (the listener reconnects; each job replays what it missed). Raises JobNotFound (JobLost:
        the record vanished meanwhile, a Redis without persistence restarted), TimeoutError
        (after `timeout_s`), ProtocolError. `resume` applies to a single job.
        Close it (`contextlib.aclosing`) if you stop early, so the channels are released."""
        resume = resume if len(job_ids) == 1 else None
        logs = {job_id: JobEvents(job_id, resume) for job_id in job_ids}
        by_channel = {self._keys.events(job_id).encode(): job_id for job_id in job_ids}
        queue: asyncio.Queue[QueueItem] = asyncio.Queue()
        deadline = _Deadline(timeout_s)
        outage = Outage()
        try:
            await self._join(list(by_channel), queue, deadline)
            # (tried again while Redis is away, as the clients' first replay is: on a cluster
            # the jobs' master may be lost between the subscription and the read)
            for item in await deadline.run(self._replay(logs, job_ids, outage)):
                yield item
            while not all(log.done for log in logs.values()):
                channel, data = await deadline.run(queue.get())
                job_id = by_channel[channel]
                if data is RESYNC:
                    for item in await deadline.run(self._replay(logs, [job_id], outage)):
                        yield item
                    continue
                event = decode_event(data)
                if logs[job_id].skips(event):  # (its stream has the one missed)
                    for item in await deadline.run(self._replay(logs, [job_id], outage)):
                        yield item
                if logs[job_id].add(event):
                    yield job_id, event
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled request still releases them
                await self._leave(list(by_channel), queue)

    async def snapshot(self, job_id: str) -> tuple[JobRecord, list[Event]]:
        """The record and every event of one job as stored now (no subscription)."""
        log = JobEvents(job_id)
        events = [event for _, event in await self._replay({job_id: log}, [job_id])]
        assert log.record is not None
        return log.record, events

    async def _replay(
        self, logs: dict[str, JobEvents], job_ids: list[str], outage: Outage | None = None
    ) -> list[tuple[str, Event]]:
        """Each job's record and events in one MULTI; with `outage`, tried again while Redis is
        away (a resync comes after a reconnect, which may not last)."""
        while True:
            pipe = pipeline(self._redis)
            for job_id in job_ids:
                pipe.hgetall(self._keys.job(job_id))
                pipe.xrange(self._keys.events(job_id))
            try:
                replies = await pipe.execute()
                break
            except REDIS_AWAY as exc:
                if outage is None:
                    raise
                await asyncio.sleep(outage.failed(exc))
        if outage is not None:
            outage.ok()
        out: list[tuple[str, Event]] = []
        for i, job_id in enumerate(job_ids):
            out += [(job_id, e) for e in logs[job_id].replay(replies[2 * i], replies[2 * i + 1])]
        return out

    # -- channel bookkeeping -------------------------------------------------------------------

    async def _join(
        self, names: list[bytes], queue: asyncio.Queue[QueueItem], deadline: _Deadline
    ) -> None:
        """Add the queue to these channels; return once Redis confirmed every subscription.
        A connection lost under the subscribe (its node killed: the listener reconnects, on a
        cluster to another node) is tried again until the deadline."""
        while True:
            await deadline.run(self._connected.wait())
            try:
                async with self._lock:
                    await self._connect()
                    new = [name for name in names if name not in self._channels]
                    for name in names:
                        self._channels.setdefault(name, _Channel()).queues.add(queue)
                    if new:
                        await self._send_subscribe(new)
                    waits = [self._channels[name].confirmed for name in names]
                break
            except (*REDIS_AWAY, OSError) as exc:
                log.warning("relay: subscribe failed (%s); trying again", exc)
                await deadline.run(asyncio.sleep(RECONNECT_BACKOFF_S))
        for confirmed in waits:
            await deadline.run(confirmed.wait())

    async def _send_subscribe(self, new: list[bytes]) -> None:
        try:
            await self._pubsub.subscribe(*new)
        except BaseException:
            for name in new:  # never sent: forget them, or they would wait forever
                self._channels.pop(name, None)
            raise

    async def _leave(self, names: list[bytes], queue: asyncio.Queue[QueueItem]) -> None:
        async with self._lock:
            gone = []
            for name in names:
                channel = self._channels.get(name)
                if channel is None:
                    continue
                channel.queues.discard(queue)
                # Unconfirmed ones stay until their confirmation arrives (see _on_subscribed).
                if not channel.queues and channel.confirmed.is_set():
                    del self._channels[name]
                    gone.append(name)
            if gone:
                await self._unsubscribe(gone)

    async def _unsubscribe(self, names: Iterable[bytes]) -> None:
        if not self._is_connected():  # (only `_connect` connects: a new pub/sub never had them,
            return  # a reconnected one re-subscribes them and _on_subscribed drops them)
        try:
            await self._pubsub.unsubscribe(*names)
        except redis.ConnectionError:  # the reconnect re-subscribes it; _on_subscribed drops it
            log.warning("relay: unsubscribe failed; Redis connection lost")

    # -- the listener ---------------------------------------------------------------------------

    async def _listen(self) -> None:
        """Read the shared connection forever; reconnect (redis-py re-subscribes) on errors."""
        while True:
            try:
                if not self._is_connected():
                    async with self._lock:
                        await self._connect()
                self._connected.set()
                message = await self._pubsub.get_message(timeout=None)
            except (*REDIS_AWAY, OSError) as exc:
                self._connected.clear()  # (a follow waits for the reconnect, not a dead link)
                log.warning("relay: Redis connection lost (%s); reconnecting", exc)
                await asyncio.sleep(RECONNECT_BACKOFF_S)
                if self._elsewhere:
                    await self._move_elsewhere()
                continue
            if message is None:
                continue
            try:
                await self._on_message(message)
            except Exception:  # one bad message must not stop every stream of the process
                log.exception("relay: dropping message %r", message)

    def _is_connected(self) -> bool:
        connection = self._pubsub.connection
        return connection is not None and connection.is_connected

    async def _connect(self) -> None:
        """(Under the lock, so no two callers open a connection each and a SUBSCRIBE goes out
        on one nobody reads.) Connect the pub/sub if it is not: redis-py's reconnect subscribes
        again what this PubSub had; one made elsewhere is given every channel."""
        if self._is_connected():
            return
        await self._pubsub.connect()
        if self._fresh and self._channels:
            await self._pubsub.subscribe(*self._channels)
        self._fresh = False

    async def _move_elsewhere(self) -> None:
        """A new pub/sub (on a cluster: on another random node), connected by the next
        `_connect`; the confirmations of its subscriptions make their followers replay, as
        after redis-py's own re-subscribe on a reconnect."""
        async with self._lock:
            old, self._pubsub = self._pubsub, self._source.pubsub()
            self._fresh = True
            with contextlib.suppress(redis.RedisError, OSError):
                await old.aclose()

    async def _on_message(self, message: dict[str, Any]) -> None:
        name = message["channel"]
        if message["type"] == "message":
            channel = self._channels.get(name)
            for queue in channel.queues if channel else ():
                queue.put_nowait((name, message["data"]))
        elif message["type"] == "subscribe":
            await self._on_subscribed(name)

    async def _on_subscribed(self, name: bytes) -> None:
        async with self._lock:
            channel = self._channels.get(name)
            if channel is None or not channel.queues:
                # Everyone left before the confirmation, or a reconnect re-subscribed a
                # channel we had left: nobody listens, so drop it.
                self._channels.pop(name, None)
                await self._unsubscribe([name])
            elif not channel.confirmed.is_set():
                channel.confirmed.set()
            else:  # re-subscribed after a reconnect: what was published meanwhile is missed
                for queue in channel.queues:
                    queue.put_nowait((name, RESYNC))


class _Deadline:
    def __init__(self, timeout_s: float | None) -> None:
        loop = asyncio.get_running_loop()
        self._timeout_s = timeout_s
        self._end = None if timeout_s is None else loop.time() + timeout_s

    async def run(self, awaitable: Any) -> Any:
        """Await it; TimeoutError once the deadline has passed."""
        if self._end is None:
            return await awaitable
        remaining = self._end - asyncio.get_running_loop().time()
        try:
            return await wait_within(awaitable, remaining)
        except TimeoutError:
            raise TimeoutError(f"no end of the job within {self._timeout_s} s") from None
