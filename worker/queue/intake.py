"""Taking jobs: the intake (XREADGROUP, new entries), the reclaimer (entries of workers that
died) and handoffs (entries another worker read and handed here, affinity), all feeding
one admission path.

Admission decodes and checks each entry, dead-letters what cannot run, marks the rest
running (START_LUA), ends at once the ones that were cancelled or are past their deadline,
and hands the others to the engine thread. A job read from the stream whose prompt start
another worker ran last goes to that worker while it has room (affinity). A reclaimed
job resumes from its events stream: the engine prefills prompt + tokens already sent, and
numbering continues.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from enum import Enum
from typing import Any

import redis
import redis.asyncio

from producer.aio import unless_set, wait_for_event
from producer.protocol import (
    ERROR_INVALID_REQUEST,
    LANES,
    Job,
    ProtocolError,
    decode_job,
    encode_event,
    entry_ref,
    ref_shard,
)
from producer.records import encode_dead_letter
from producer.redis_conn import xreadgroup
from worker.queue.affinity import Affinity
from worker.queue.config import WorkerConfig
from worker.queue.engine_thread import AddRequest, EngineThread
from worker.queue.jobs import (
    ABORT_CANCELLED,
    ABORT_DEADLINE,
    HeldJob,
    JobState,
    JobTable,
    abort_events,
    error_event,
    failed_record,
    final_record,
    job_meter,
    new_completions,
    progress_from_events,
)
from worker.queue.metrics import WorkerMetrics
from worker.queue.scripts import DeadLetter, Forward, JobWrite, Scripts

logger = logging.getLogger(__name__)

INTAKE_BLOCK_S = 1.0  # longest XREADGROUP BLOCK: bounds how long a stop waits for intake
REDIS_RETRY_S = 1.0  # pause after a Redis connection error before trying again


@dataclass(frozen=True)
class Delivery:
    """One stream entry handed to this worker."""

    entry_id: str
    fields: dict[bytes, bytes] | None  # None: deleted from the stream before it ran
    delivery_count: int = 1  # including this one


class Source(Enum):
    """How entries came to this worker."""

    READ = "read"  # XREADGROUP: new entries
    RECLAIMED = "reclaimed"  # idle entries of a worker gone: resumed from their events
    HANDED = "handed"  # read by another worker, whose owner by affinity this worker is


KEEP_UNDECODABLE_BYTES = 64 << 10  # an undecodable entry larger than this is not copied to genq:dead


@dataclass(frozen=True)
class Rejection:
    reason: str
    job_id: str | None = None
    fail_job: bool = True  # False: the job is alive elsewhere (duplicate entry); leave it
    error_type: str | None = ERROR_INVALID_REQUEST  # None: not the job's fault
    # set: the entry's size, over the limit; dead-lettered without its payload and deleted
    entry_bytes: int | None = None


class Admission:
    def __init__(
        self, config: WorkerConfig, scripts: Scripts, table: JobTable, engine: EngineThread,
        metrics: WorkerMetrics,
    ) -> None:
        self.config = config
        self.scripts = scripts
        self.table = table
        self.engine = engine
        self.metrics = metrics
        self.affinity = Affinity(config, scripts)
        self.num_admitting = 0  # entries read and not yet handed on (counted against capacity)
        self.num_adds_sent = 0  # AddRequests sent to the engine thread, ever

    async def admit(self, deliveries: list[Delivery], source: Source) -> None:
        self.num_admitting += len(deliveries)
        try:
            await self._admit(deliveries, source)
        finally:
            self.num_admitting -= len(deliveries)
            self._forget_unstarted(deliveries)

    def _forget_unstarted(self, deliveries: list[Delivery]) -> None:
        # Race prevented: a Redis error mid-admission leaving jobs held but never started; the
        # heartbeat would keep re-owning their entries, and no worker would ever run them.
        # Forgotten here, they go idle and are reclaimed.
        for delivery in deliveries:
            held = self.table.by_entry(delivery.entry_id)
            if held is not None and held.state == JobState.ADMITTING:
                self.table.remove(held)

    async def _admit(self, deliveries: list[Delivery], source: Source) -> None:
        checked = await self._route([(d, self.check(d)) for d in deliveries])
        if source == Source.READ:  # (a handed job stays: no handing back and forth)
            checked = await self._hand_off(checked)
        progress = await self._read_progress(checked) if source == Source.RECLAIMED else {}
        letters, held = [], []
        for delivery, verdict in checked:
            if isinstance(verdict, Job):  # again: two entries of one job can share a batch
                verdict = self._check_not_held(delivery, verdict) or verdict
            if isinstance(verdict, Rejection):
                letters.append(self._dead_letter(delivery, verdict, progress))
            else:
                held.append(self._hold(delivery, verdict, progress))
        await self.scripts.dead_letter(letters)
        for letter in letters:
            logger.warning("entry %s -> dead: %s", letter.entry_id, letter.fields["reason"].decode())
        codes = await self.scripts.start(
            [h.job for h in held], [h.entry_id for h in held], time.time()
        )
        # owned before the jobs can end: a reply's follow-up may come at once
        await self.affinity.own([h.job for h, code in zip(held, codes, strict=True) if code == "run"])
        await self._dispatch(list(zip(held, codes, strict=True)))

    # -- checks, each a delivery rule ------------------------------------------------------

    def check(self, delivery: Delivery) -> Job | Rejection:
        """The job to run, or why the entry cannot run."""
        if delivery.fields is None:
            return Rejection("the entry was deleted from the stream before it ran", error_type=None)
        if (oversize := self._check_size(delivery.fields)) is not None:
            return oversize
        try:
            job = decode_job(delivery.fields)
        except ProtocolError as exc:
            return _undecodable(delivery.fields, exc)
        return (self._check_shard(delivery, job) or self._check_delivery_limit(delivery, job)
                or self._check_not_held(delivery, job) or job)

    def _check_shard(self, delivery: Delivery, job: Job) -> Rejection | None:
        # Race prevented: a job whose entry a process splitting the streams otherwise put in
        # another shard than its id's (redis-cli, or a GENQ_REDIS_SHARDS mismatch that slipped
        # past producer.shards): its record lives in another slot, so no script could start it.
        keys, shard = self.scripts.keys, ref_shard(delivery.entry_id)
        if keys.shard_of(job.id) == shard:
            return None
        return Rejection(
            f"job {job.id} belongs in request-stream shard {keys.shard_of(job.id)} of {keys.shards}, but its "
            f"entry is in shard {shard}: written by a process that splits the streams otherwise",
            job.id, fail_job=False,
        )

    def _check_size(self, fields: dict[Any, Any]) -> Rejection | None:
        # Race prevented: a huge entry (redis-cli, a client past the API's size limit) stored
        # twice, in the requests stream and again in the dead stream, for the dead stream's week.
        size = _entry_bytes(fields)
        if size <= self.config.max_entry_bytes:
            return None
        job_id = fields.get(b"id")  # (the payload is not decoded: its id is beside it)
        return Rejection(
            f"the entry is {size} bytes, over this worker's limit of {self.config.max_entry_bytes} "
            "(max_entry_bytes): refused unread, its payload not kept",
            job_id.decode(errors="replace") if isinstance(job_id, bytes) and job_id else None, entry_bytes=size,
        )

    def _check_delivery_limit(self, delivery: Delivery, job: Job) -> Rejection | None:
        # Race prevented: a job that kills every worker that runs it (a poison prompt) being
        # reclaimed and crashing worker after worker forever.
        if delivery.delivery_count <= self.config.delivery_limit:
            return None
        return Rejection(
            f"delivered {delivery.delivery_count} times, over the delivery limit of "
            f"{self.config.delivery_limit}: every worker that took it stopped before finishing",
            job.id, error_type=None,
        )

    def _serves(self, job: Job) -> bool:
        return self.config.serves(job.model) or job.model in self.engine.adapters.served

    async def _route(
        self, checked: list[tuple[Delivery, Job | Rejection]]
    ) -> list[tuple[Delivery, Job | Rejection]]:
        """Jobs for a model this worker does not serve: forwarded to the queue whose workers
        advertise it (and dropped from `checked`), or rejected when no live worker does.

        Race prevented: a job for one model, XADDed to the shared stream by a producer that
        does not route (redis-cli), dead-lettered by a worker of another model although a
        pool serving it is up."""
        unserved = {d.entry_id: v for d, v in checked if isinstance(v, Job) and not self._serves(v)}
        if not unserved:
            return checked
        routes = await self.scripts.routes(sorted({job.model for job in unserved.values() if job.model}))
        moves = [
            Forward(d.entry_id, v.id, routes[v.model], d.fields or {})
            for d, v in checked
            if d.entry_id in unserved and isinstance(v, Job) and v.model
            and routes.get(v.model, self.config.queue) != self.config.queue
        ]
        codes = dict(zip([m.entry_id for m in moves], await self.scripts.forward(moves), strict=True))
        out: list[tuple[Delivery, Job | Rejection]] = []
        for delivery, verdict in checked:
            job = unserved.get(delivery.entry_id)
            code = codes.get(delivery.entry_id)
            if job is None:
                out.append((delivery, verdict))
            elif code == "moved":
                logger.info("job %s for model %r forwarded to queue %r", job.id, job.model, routes[job.model or ""])
            elif code == "duplicate":
                reason = f"duplicate entry for job {job.id}: its record names another entry"
                out.append((delivery, Rejection(reason, job.id, fail_job=False)))
            elif code is None:
                out.append((delivery, self._unserved(job)))
            # lost: another worker took the entry meanwhile; it is theirs to run or move
        return out

    async def _hand_off(
        self, checked: list[tuple[Delivery, Job | Rejection]]
    ) -> list[tuple[Delivery, Job | Rejection]]:
        """Jobs whose prompt start another worker of this stream ran last: handed to it while
        it has room (affinity), and dropped from `checked`."""
        handed = await self.affinity.hand_off([(d.entry_id, v) for d, v in checked if isinstance(v, Job)])
        self.metrics.handed_off(len(handed))
        return [(d, v) for d, v in checked if d.entry_id not in handed]

    async def take_handed(self, text: str) -> None:
        """Admit the entries of a handoff notice (their ids, space-separated) still this
        worker's; hand them back where it takes no jobs now (it sleeps or is paused since)."""
        taken = await self.scripts.take(text.split())
        fresh = [t for t in taken if self.table.by_entry(t.entry_id) is None]
        if fresh and not self.engine.takes_jobs:
            await self.scripts.release([t.entry_id for t in fresh])  # (for a worker that takes them)
        elif fresh:
            self.metrics.handed_in(len(fresh))
            await self.admit([Delivery(t.entry_id, t.fields, t.delivery_count) for t in fresh], Source.HANDED)

    def _unserved(self, job: Job) -> Rejection:
        adapters = ", ".join(self.engine.adapters.served)
        return Rejection(
            f"model {job.model!r} is not served by this worker pool "
            f"(worker {self.config.name} serves {self.config.model_name!r}"
            + (f" and LoRA adapters {adapters}" if adapters else "")
            + "), and no live worker of another queue advertises it",
            job.id,
        )

    def _check_not_held(self, delivery: Delivery, job: Job) -> Rejection | None:
        # Race prevented: a second entry for a job this worker is running (a producer that
        # XADDed twice) replacing the running job's bookkeeping.
        held = self.table.get(job.id)
        if held is None or held.entry_id == delivery.entry_id:
            return None
        return Rejection(
            f"duplicate entry for job {job.id} (this worker runs it from entry {held.entry_id})",
            job.id, fail_job=False,
        )

    # -- building ----------------------------------------------------------------------------

    async def _read_progress(
        self, checked: list[tuple[Delivery, Job | Rejection]]
    ) -> dict[str, Any]:
        """Events streams of reclaimed jobs (XRANGE replies), by job id, in one round trip."""
        named = (v.id if isinstance(v, Job) else v.job_id for _, v in checked)
        job_ids = sorted({job_id for job_id in named if job_id is not None})
        pipe = self.scripts.conn.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.xrange(self.scripts.keys.events(job_id))
        return dict(zip(job_ids, await pipe.execute(), strict=True))

    def _hold(self, delivery: Delivery, job: Job, progress: dict[str, Any]) -> HeldJob:
        n = job.sampling_params.n
        entries = progress.get(job.id)
        completions = progress_from_events(n, entries) if entries else new_completions(n)
        held = HeldJob(
            job, delivery.entry_id, completions, delivery.delivery_count,
            resumed=any(c.next_seq > 0 for c in completions),
        )
        self.table.add(held)
        return held

    def _dead_letter(
        self, delivery: Delivery, rejection: Rejection, progress: dict[str, Any]
    ) -> DeadLetter:
        job_id, dropped = rejection.job_id, rejection.entry_bytes is not None
        fields = encode_dead_letter(
            delivery.entry_id, {} if dropped else delivery.fields or {}, rejection.reason, job_id, rejection.entry_bytes
        )
        # (a job's record in another shard than the entry is out of the script's slot: left)
        if job_id is None or not rejection.fail_job or self.scripts.keys.shard_of(job_id) != ref_shard(delivery.entry_id):
            return DeadLetter(delivery.entry_id, fields, drop=dropped)
        entries = progress.get(job_id)
        try:
            completions = progress_from_events(1, entries) if entries else None
        except ProtocolError:
            completions = None  # unreadable events: seq 0 is the best guess
        event = encode_event(error_event(completions, rejection.reason, rejection.error_type))
        record = failed_record(rejection.reason, self.config.name, time.time(), rejection.error_type)
        return DeadLetter(delivery.entry_id, fields, job_id, event, record, drop=dropped)

    async def fail_held(self, held: HeldJob, error: str, error_type: str | None) -> None:
        """Fail a job already taken (the engine refused it): error event, failed record,
        entry to the dead stream."""
        keys = self.scripts.keys
        pipe = self.scripts.conn.pipeline(transaction=False)
        stream, entry_id = keys.locate(held.entry_id)
        pipe.xrange(stream, entry_id, entry_id)
        pipe.xrange(keys.events(held.id))
        entry, events = await pipe.execute()
        delivery = Delivery(held.entry_id, entry[0][1] if entry else {}, held.delivery_count)
        rejection = Rejection(error, held.id, error_type=error_type)
        letter = self._dead_letter(delivery, rejection, {held.id: events})
        await self.scripts.dead_letter([letter])
        logger.warning("job %s failed: %s", held.id, error)

    # -- after START ---------------------------------------------------------------------------

    async def _dispatch(self, started: list[tuple[HeldJob, str]]) -> None:
        now = time.time()
        end_now: list[HeldJob] = []
        letters: list[DeadLetter] = []
        for held, code in started:
            if held.state != JobState.ADMITTING:
                continue  # the heartbeat found the entry taken by another worker meanwhile
            if code == "run":
                if held.abort_reason is None and held.past_deadline(now):
                    held.abort_reason = ABORT_DEADLINE
                if held.abort_reason is not None or held.finished:
                    end_now.append(held)
                else:
                    self._to_engine(held)
                continue
            if code == "cancelled":
                held.abort_reason = ABORT_CANCELLED
                end_now.append(held)
                continue
            self.table.remove(held)
            if code == "lost":  # another worker claimed it between our read and the start
                logger.warning("job %s: entry %s was claimed elsewhere before it started", held.id, held.entry_id)
            if code in ("duplicate", "ended"):
                reason = (
                    f"job {held.id} already ended" if code == "ended"
                    else f"duplicate entry for job {held.id}: its record names another entry"
                )
                fields = encode_dead_letter(held.entry_id, {}, reason, held.id)
                letters.append(DeadLetter(held.entry_id, fields))
        await self.scripts.dead_letter(letters)
        await self.end_unstarted(end_now)

    def _to_engine(self, held: HeldJob) -> None:
        """Queue the job in the engine; a resumed n > 1 job runs one request per unfinished
        completion, each primed with its own tokens."""
        held.state = JobState.RUNNING
        self.metrics.taken(held)
        if held.resumed and held.job.sampling_params.n > 1:
            requests = [
                AddRequest(self.table.new_engine_id(held, c.index), held.job, c.index, list(c.token_ids))
                for c in held.completions if not c.finished
            ]
        else:
            resume = list(held.completions[0].token_ids) if held.resumed else None
            requests = [AddRequest(self.table.new_engine_id(held), held.job, None, resume)]
        for request in requests:
            self.engine.add(request)
        self.num_adds_sent += len(requests)

    async def end_unstarted(self, jobs: list[HeldJob]) -> None:
        """End jobs that never reach the engine (cancelled, past their deadline): final
        `abort` events, record and XACK in one STEP_LUA call."""
        if not jobs:
            return
        now = time.time()
        writes = []
        for held in jobs:
            events = [encode_event(e) for e in abort_events(held)]
            writes.append(JobWrite(held.id, held.entry_id, events, final_record(held, self.config.name, now),
                                   job_meter(held, self.config.model_name, now)))
        await self.scripts.publish(writes)
        for held in jobs:
            logger.info("job %s ended before running (%s)", held.id, held.abort_reason or "done")
            self.table.remove(held)


def _entry_bytes(fields: dict[Any, Any]) -> int:
    return sum(len(k) + len(v) for k, v in fields.items())


def _undecodable(fields: dict[Any, Any], exc: ProtocolError) -> Rejection:
    """An entry that cannot be decoded: dead-lettered with its fields when they are small
    enough to read by eye, else (as an oversize one) with its size alone, and deleted. No
    retry could run it, so a large copy would only keep its bytes twice for a week."""
    size = _entry_bytes(fields)
    if size <= KEEP_UNDECODABLE_BYTES:
        return Rejection(f"cannot decode the entry: {exc}", exc.job_id)
    return Rejection(f"cannot decode the entry ({size} bytes, not kept): {exc}", exc.job_id, entry_bytes=size)


class Intake:
    """XREADGROUP as many new entries as the engine has room for (LaneReader); block while
    idle.

    One loop per request-stream shard (one on a single Redis), each with its own LaneReader:
    the loops take turns at reading what is ready (one at a time, so the room is counted once;
    the turn is FIFO, so each shard gets its share), and while nothing is, each blocks on its
    own shard's streams (then a burst may bring each shard's loop an entry per lane beyond the
    room: the engine queues them)."""

    def __init__(
        self,
        admission: Admission,
        capacity: Callable[[], int],
        changed: asyncio.Event,
        takes_jobs: Callable[[], bool] = lambda: True,
    ) -> None:
        self.admission = admission
        self.scripts = admission.scripts
        self.capacity = capacity
        self.changed = changed  # set when the engine's load changed
        self.takes_jobs = takes_jobs  # False while the engine sleeps, or is to (sleep mode)
        self.readers = [LaneReader(admission.scripts, admission.config, n) for n in range(self.scripts.keys.shards)]
        self.turn = asyncio.Lock()  # whose turn it is to read what is ready

    async def run(self, stopping: asyncio.Event) -> None:
        await asyncio.gather(*(self._run_shard(reader, stopping) for reader in self.readers))

    async def _run_shard(self, reader: LaneReader, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            self.changed.clear()  # before reading capacity, so no change is missed
            async with self.turn:
                count = self.capacity()
                ready = await self._read(reader.read_ready(count)) if count > 0 else []
            # (no await between the turn's end and admit counting the entries it admits)
            if count <= 0:
                await unless_set(wait_for_event(self.changed, INTAKE_BLOCK_S), stopping)
                continue
            # a stop cuts the blocking read short: entries it took are in this consumer's
            # pending list, which the drain hands back; admission itself is never cut
            deliveries = ready or await unless_set(self._read(reader.wait()), stopping)
            if deliveries and not self.takes_jobs():  # asleep since the read began: for a worker awake
                await self.scripts.release([d.entry_id for d in deliveries])  # (this one's reclaimer, woken)
            elif deliveries:
                await self.admission.admit(deliveries, Source.READ)

    async def _read(self, reading: Coroutine[Any, Any, list[Delivery]]) -> list[Delivery]:
        try:
            return await reading
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await self.scripts.ensure_group()  # the stream or group was deleted (FLUSHALL)
            return []


class LaneReader:
    """Reads new entries from the priority lanes in their order: a lane is read only when
    those before it have nothing new; while all are empty, one blocking read waits on them all.

    Lanes age: a lane passed over while its oldest entry has waited `lane_aging_s` is owed one
    entry for every `lane_aged_every - 1` read ahead of it, and is read first next time. So a
    steady load of higher work slows a lower lane down to a share of this worker's reads but
    never stops it, and a burst of higher work shorter than the aging still goes first."""

    def __init__(self, scripts: Scripts, config: WorkerConfig, shard: int = 0) -> None:
        self.scripts = scripts
        self.shard = shard
        self.keys = scripts.keys.on_shard(shard)  # this shard's streams
        self.aging_s = config.lane_aging_s
        self.per_owed = config.lane_aged_every - 1  # entries read ahead, per entry owed
        # entries read ahead of each lower lane while its oldest one waited past the aging
        self.passed = dict.fromkeys(LANES[1:], 0)

    async def read(self, count: int) -> list[Delivery]:
        """Up to `count` new entries; blocks up to INTAKE_BLOCK_S while there are none."""
        return await self.read_ready(count) or await self.wait()

    async def read_ready(self, count: int) -> list[Delivery]:
        """Up to `count` new entries, without waiting."""
        deliveries = await self._read_owed(count)
        read: dict[str, int] = {}  # the lanes reached, in order: entries read from each
        for lane in LANES:
            if len(deliveries) >= count:
                break
            got = await self._read_lanes([lane], count - len(deliveries), None)
            read[lane] = len(got)
            deliveries += got
        await self._age(read)
        return deliveries

    async def wait(self) -> list[Delivery]:
        """Nothing new anywhere: wait on every lane at once, for one entry each (a lane woken
        first then has its followers read lane by lane next time round)."""
        return await self._read_lanes(list(LANES), 1, int(INTAKE_BLOCK_S * 1000))

    async def _read_owed(self, count: int) -> list[Delivery]:
        """The entries aged lanes are owed, up to `count`."""
        deliveries: list[Delivery] = []
        for lane, passed in self.passed.items():
            owed = min(passed // self.per_owed, count - len(deliveries))
            if owed > 0:
                deliveries += await self._read_lanes([lane], owed, None)
                self.passed[lane] = passed - owed * self.per_owed  # (a lane that ran out: _age zeroes)
        return deliveries

    async def _age(self, read: dict[str, int]) -> None:
        """After a read that reached the lanes in `read`: a lane reached is not passed over;
        one the read filled up before is passed over by everything read, if its oldest entry
        has waited past the aging."""
        skipped = [lane for lane in self.passed if lane not in read]
        for lane in self.passed:
            if lane in read:
                self.passed[lane] = 0
        if not skipped or self.aging_s <= 0:
            return
        waits = await self.scripts.lane_waits(skipped, self.shard)
        ahead = sum(read.values())
        for lane in skipped:
            wait = waits[lane]
            self.passed[lane] = self.passed[lane] + ahead if wait is not None and wait >= self.aging_s else 0

    async def _read_lanes(self, lanes: list[str], count: int, block_ms: int | None) -> list[Delivery]:
        keys = self.keys
        streams = {keys.on_lane(lane).requests: ">" for lane in lanes}
        reply = await xreadgroup(self.scripts.conn, keys.group, self.scripts.consumer, streams, count, block_ms)
        lane_of_stream = {keys.on_lane(lane).requests: lane for lane in lanes}
        return [
            Delivery(entry_ref(_str(entry_id), lane_of_stream[_str(stream)], self.shard), fields)
            for stream, entries in reply or [] for entry_id, fields in entries
        ]


class Reclaimer:
    """Every heartbeat, claim entries idle past the claim timeout and resume them."""

    def __init__(
        self, admission: Admission, capacity: Callable[[], int], table: JobTable,
        config: WorkerConfig,
    ) -> None:
        self.admission = admission
        self.capacity = capacity
        self.table = table
        self.config = config

    async def run(self, stopping: asyncio.Event) -> None:
        while not await wait_for_event(stopping, self.config.heartbeat_s):
            await self.reclaim_once()

    async def reclaim_once(self) -> int:
        count = self.capacity()
        if count <= 0:
            return 0
        min_idle_ms = int(self.config.claim_idle_s * 1000)
        try:
            claimed = await self.admission.scripts.reclaim(min_idle_ms, count)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await self.admission.scripts.ensure_group()
            return 0
        # An entry already held here went idle because a heartbeat came late; the claim just
        # re-owned it. It is running: do not admit it twice.
        fresh = [c for c in claimed if self.table.by_entry(c.entry_id) is None]
        deliveries = [Delivery(c.entry_id, c.fields, c.delivery_count) for c in fresh]
        if deliveries:
            logger.info("reclaimed %d idle entries: %s", len(deliveries), [d.entry_id for d in deliveries])
            await self.admission.admit(deliveries, Source.RECLAIMED)
        return len(deliveries)



def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
