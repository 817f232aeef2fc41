"""The worker's bookkeeping for the jobs it holds: plain Python, no Redis, no torch.

A job's progress is per completion index: the next `seq`, the tokens and text sent so far and
the finish reason. A fresh job starts empty; a reclaimed one starts from its events stream, so
numbering and text continue where the previous worker stopped.
"""

from __future__ import annotations

import collections
import enum
import functools
import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from producer.protocol import (
    EVENT_FIELD,
    FINISH_ABORT,
    Event,
    Job,
    JobStatus,
    ProtocolError,
    decode_event,
    pack_embedding,
    ref_shard,
)
from producer.records import CompletionOutput, JobRecord, encode_record

ABORT_CANCELLED = "cancelled"  # JobRecord.extra["abort_reason"]: the client cancelled
ABORT_DEADLINE = "deadline"  # the job's deadline passed
ABORT_PAUSED = "paused"  # a pause with mode "abort" (genq:pause:<model>) ended it


class JobState(enum.Enum):
    """A held job: admitting -> running -> (removed when finished); or dropped as
    released / lost, when outputs are no longer written for it."""

    ADMITTING = "admitting"  # read from the stream, not yet started
    RUNNING = "running"  # in the engine
    RELEASED = "released"  # handed back at shutdown; its outputs are dropped
    LOST = "lost"  # another worker owns the entry now; its outputs are dropped

    @property
    def writes(self) -> bool:
        return self in (JobState.ADMITTING, JobState.RUNNING)


@dataclass
class Completion:
    """Progress of one completion index."""

    index: int
    next_seq: int = 0
    text: list[str] = field(default_factory=list)  # pieces sent
    token_ids: list[int] = field(default_factory=list)  # tokens sent
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            self.index, "".join(self.text), list(self.token_ids), self.finish_reason, self.stop_reason
        )


@dataclass
class Unsent:
    """One completion's engine deltas held for a coalesced event, merged in order: the texts
    and tokens concatenate (each delta's text is the detokenizer's new text, so the pieces add
    up to what one event per step would have said), the logprobs too, one per token."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_timestamps: list[float] | None = None  # (Whisper: sent whole, on the final delta)

    def add(self, text: str, token_ids: list[int], finish_reason: str | None, stop_reason: int | str | None,
            logprobs: list[Any] | None, token_timestamps: list[float] | None) -> None:
        self.text.append(text)
        self.token_ids.extend(token_ids)
        if logprobs is not None:
            self.logprobs = [*(self.logprobs or []), *logprobs]
        self.finish_reason, self.stop_reason = finish_reason, stop_reason
        if token_timestamps is not None:
            self.token_timestamps = token_timestamps


@dataclass
class HeldJob:
    """A job this worker holds, from intake until its final write."""

    job: Job
    entry_id: str
    completions: list[Completion]
    delivery_count: int = 1
    resumed: bool = False  # reclaimed with output already sent by another worker
    state: JobState = JobState.ADMITTING
    abort_reason: str | None = None  # ABORT_CANCELLED | ABORT_DEADLINE | ABORT_PAUSED once asked to stop
    engine_ids: set[str] = field(default_factory=set)  # engine requests not finished yet
    prompt_tokens: int | None = None
    cached_tokens: int = 0  # prompt tokens the prefix cache served
    embedding: list[float] | None = None  # an embedding job's vector, once pooled
    received_at: float = field(default_factory=time.time)  # unix time it came off the stream
    first_token_at: float | None = None  # unix time of the step that sent its first token
    last_token_at: float | None = None  # unix time of the last step that sent a token
    # prompt logprobs (wire form) and the decoded prompt, waiting for completion 0's first
    # event; a job resumed after that event never sets them
    prompt_logprobs: list[Any] | None = None
    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None  # kept for a job that asks for them (return_prompt_token_ids)
    # coalesced events (stream_interval_ms): tokens made but not yet published, per completion index
    unsent: dict[int, Unsent] = field(default_factory=dict)
    unsent_tenant_tokens: int = 0  # tokens for the tenant's minute, counted with the next publish

    @property
    def id(self) -> str:
        return self.job.id

    @functools.cached_property
    def shard(self) -> int:
        """The request-stream shard its entry is in (0 on a single Redis; the entry is the job's
        for as long as it is held)."""
        return ref_shard(self.entry_id)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)

    def usage(self) -> dict[str, int] | None:
        if self.prompt_tokens is None:
            return None
        completion = self.num_output_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "cached_tokens": self.cached_tokens,
        }

    def past_deadline(self, now: float) -> bool:
        return self.job.deadline is not None and now >= self.job.deadline


def new_completions(n: int) -> list[Completion]:
    return [Completion(index=i) for i in range(n)]


def progress_from_events(n: int, entries: Iterable[tuple[Any, dict[bytes, bytes]]]) -> list[Completion]:
    """Rebuild per-index progress from an events stream (XRANGE reply); raises ProtocolError.
    Events at or below an index's last seq are skipped, as readers skip them."""
    completions = new_completions(n)
    for _, entry_fields in entries:
        data = entry_fields.get(EVENT_FIELD.encode())
        if data is None:
            raise ProtocolError(f"events entry has no {EVENT_FIELD!r} field")
        event = decode_event(data)
        if event.error is not None or not 0 <= event.index < n:
            continue
        c = completions[event.index]
        if event.seq < c.next_seq:
            continue
        c.next_seq = event.seq + 1
        c.text.append(event.text)
        c.token_ids.extend(event.token_ids)
        if event.finished:
            c.finish_reason, c.stop_reason = event.finish_reason, event.stop_reason
    return completions


def completion_event(
    held: HeldJob,
    index: int,
    text: str,
    token_ids: list[int],
    finish_reason: str | None,
    stop_reason: int | str | None = None,
    logprobs: list[Any] | None = None,
    token_timestamps: list[float] | None = None,
) -> Event | None:
    """Record one engine delta for completion `index` and return its event (None when the
    delta carries nothing, or the completion had already finished)."""
    c = held.completions[index]
    if c.finished or not (token_ids or text or finish_reason):
        return None
    c.text.append(text)
    c.token_ids.extend(token_ids)
    c.finish_reason, c.stop_reason = finish_reason, stop_reason
    event = Event(
        seq=c.next_seq, token_ids=list(token_ids), text=text, finished=finish_reason is not None,
        finish_reason=finish_reason, stop_reason=stop_reason, index=index, logprobs=logprobs,
        token_timestamps=token_timestamps,
    )
    if index == 0 and c.next_seq == 0 and held.prompt_logprobs is not None:
        event.prompt_logprobs, event.prompt = held.prompt_logprobs, held.prompt_text
        held.prompt_logprobs = held.prompt_text = None
    if event.finished or c.next_seq == 0:  # the first event's: readers know the prompt's count early
        event.usage = held.usage()
    if c.next_seq == 0:
        event.prompt_token_ids = held.prompt_token_ids
    c.next_seq += 1
    if event.finished:
        if held.embedding is not None:
            event.embedding = pack_embedding(held.embedding)
    return event


def hold_delta(
    held: HeldJob,
    index: int,
    text: str,
    token_ids: list[int],
    finish_reason: str | None,
    stop_reason: int | str | None = None,
    logprobs: list[Any] | None = None,
    token_timestamps: list[float] | None = None,
) -> int:
    """Keep one engine delta of completion `index` until the job's next publish; returns its
    new tokens (0 once the completion had finished: nothing more is sent for it)."""
    if held.completions[index].finished:
        return 0
    held.unsent.setdefault(index, Unsent()).add(text, token_ids, finish_reason, stop_reason, logprobs,
                                                token_timestamps)
    return len(token_ids)


class TokenRate:
    """The tokens a worker made over the last `window_s` seconds, per second."""

    def __init__(self, window_s: float = 1.0) -> None:
        self.window_s = window_s
        self._made: collections.deque[tuple[float, int]] = collections.deque()  # (when, tokens)
        self._total = 0

    def add(self, now: float, tokens: int) -> None:
        if tokens:
            self._made.append((now, tokens))
            self._total += tokens
        while self._made and self._made[0][0] <= now - self.window_s:
            self._total -= self._made.popleft()[1]

    @property
    def per_s(self) -> float:
        return self._total / self.window_s


def coalescing_interval_s(interval_s: float, rate: TokenRate, min_tokens_per_s: float, step_s: float = 0.0) -> float:
    """How long a job's tokens may be held now: `interval_s` while the worker makes at least
    `min_tokens_per_s` tokens a second (there merging events spares Redis real work) and its
    steps (`step_s`, the last) take at most half the interval, else 0: every step publishes, and
    streams keep one step's gaps (a CPU step of 30-100 ms, against an H200's 10, would merge
    nothing: a held step's tokens would go out with the next)."""
    return interval_s if rate.per_s >= min_tokens_per_s and 2 * step_s <= interval_s else 0.0


def publish_due(held: HeldJob, interval_s: float) -> bool:
    """Whether the job's held deltas go out now, off its shard's turn (ShardTurns). Always with
    no interval; at once for a completion's first event (time to first token is never delayed)
    and a final delta (finish, stop, abort: a cancelled job's held tokens go out with its abort)."""
    if not held.unsent:
        return False
    if interval_s <= 0:
        return True
    for index, unsent in held.unsent.items():
        if unsent.finish_reason is not None or held.completions[index].next_seq == 0:
            return True
    return False


class ShardTurns:
    """When the held tokens of a shard's jobs go out: all together, on the shard's turn.

    A worker calls the STEP script once per request-stream shard its writes touch, and on a Redis
    Cluster a master pays for each call more than for the events it carries. So held tokens go
    out by shard, not by job: a shard's turn comes `interval_s` after its jobs began holding
    tokens, then every interval while any of them still holds; on it every held job of the shard
    publishes. A step then writes to the shards whose turn it is (and those of firsts and
    finals), not to every shard. Readers still get a job's tokens at least every interval: a
    turn comes where the next step would end past it (`step_s`, the engine's last step).

    The shards' turns are spread over the interval (shard n of K begins n/K of an interval
    ahead), so that shards that start holding together, at a worker's start, do not all write
    on the same steps. A single Redis has one shard: every held job publishes on the same steps.

    A step's outputs first go out where publish_due says so; the jobs left holding tokens start
    their shards' clocks (`holding`); then `due` says whose turn it is, a clock started at
    this step included."""

    def __init__(self, num_shards: int = 1) -> None:
        self.num_shards = num_shards
        self._since: dict[int, float] = {}  # shard -> its last turn (or when it began holding, less its phase)

    def holding(self, shard: int, since: float, interval_s: float) -> None:
        """A job of `shard` holds tokens made since `since` (the step before, when it last
        published or began): the shard's clock starts there if it had none."""
        if shard not in self._since:
            self._since[shard] = since - interval_s * (shard % self.num_shards) / self.num_shards

    def due(self, now: float, interval_s: float, step_s: float) -> set[int]:
        """The shards whose turn it is at the step ending `now`; their clocks restart at `now`."""
        due = {shard for shard, since in self._since.items() if now - since + step_s > interval_s}
        for shard in due:
            self._since[shard] = now
        return due

    def next_at(self, interval_s: float) -> float | None:
        """When the next turn comes with no step (unix time; None: no shard holds tokens)."""
        return min(self._since.values()) + interval_s if self._since else None

    def keep(self, holding: Iterable[int], turned: set[int]) -> None:
        """Forget the clocks of the shards none of whose jobs holds tokens now (`holding`: the
        shards of those that do), but for those whose turn it just was (`turned`): their jobs'
        next tokens are held from this turn, at its phase. A shard that holds again after a
        step with nothing held starts a fresh interval."""
        kept = set(holding) | turned
        if len(kept) < len(self._since):
            self._since = {shard: since for shard, since in self._since.items() if shard in kept}


def unsent_events(held: HeldJob) -> list[Event]:
    """The held deltas as one event per completion (index order), recorded as sent."""
    events = []
    for index in sorted(held.unsent):
        u = held.unsent[index]
        event = completion_event(held, index, "".join(u.text), u.token_ids, u.finish_reason, u.stop_reason,
                                 u.logprobs, u.token_timestamps)
        if event is not None:
            events.append(event)
    held.unsent.clear()
    return events


def abort_events(held: HeldJob) -> list[Event]:
    """Final `abort` events for every completion not finished yet (cancel, deadline)."""
    events = []
    for c in held.completions:
        event = completion_event(held, c.index, "", [], FINISH_ABORT)
        if event is not None:
            events.append(event)
    return events


def final_record(held: HeldJob, worker: str, now: float) -> dict[str, str | bytes]:
    """The job hash fields written with the last events (HSET mapping)."""
    outputs = [c.output() for c in held.completions]
    reasons = {c.finish_reason for c in held.completions}
    status = JobStatus.CANCELLED if reasons == {FINISH_ABORT} else JobStatus.FINISHED
    record = JobRecord(
        status=status,
        n=len(held.completions),
        worker=worker,
        finished_at=now,
        prompt_tokens=held.prompt_tokens,
        completion_tokens=held.num_output_tokens,
        cached_tokens=held.cached_tokens if held.prompt_tokens is not None else None,
        finish_reason=outputs[0].finish_reason,
        text=outputs[0].text,
        outputs=outputs,
        embedding=held.embedding,
    )
    if status == JobStatus.CANCELLED and held.abort_reason is not None:
        record.extra["abort_reason"] = held.abort_reason
    return encode_record(record)


@dataclass(frozen=True)
class Meter:
    """What a finishing job adds to its day's usage (`Keys.usage`). (Its tenant's minute,
    `Keys.tokens`, counts its tokens as they come: `TenantTokens`.)"""

    day: str  # UTC, YYYY-MM-DD
    tenant: str  # "" when the job names none
    model: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt tokens, those the prefix cache served


@dataclass(frozen=True)
class TenantTokens:
    """Tokens a publish adds to the job's tenant's minute (`Keys.tokens`, read against
    GENQ_RATE_LIMIT_TPM): its prompt as it is read, then its new tokens step by step, so a
    long generation counts while it runs, in the minutes it runs in."""

    tenant: str
    minute: int  # unix time // 60
    tokens: int


def job_meter(held: HeldJob, served_model: str, now: float) -> Meter:
    """What the job adds to its day's usage as it ends: under its tenant and the model it named
    (the served model when it named none), its prompt and generated tokens."""
    usage = held.usage() or {}
    return Meter(
        day=time.strftime("%Y-%m-%d", time.gmtime(now)), tenant=held.job.tenant or "",
        model=held.job.model or served_model, prompt_tokens=usage.get("prompt_tokens", 0),
        completion_tokens=usage.get("completion_tokens", 0), cached_tokens=usage.get("cached_tokens", 0),
    )


def failed_record(
    error: str, worker: str, now: float, error_type: str | None = None
) -> dict[str, str | bytes]:
    return encode_record(JobRecord(
        status=JobStatus.FAILED, worker=worker, error=error, error_type=error_type, finished_at=now,
    ))


def error_event(completions: list[Completion] | None, error: str, error_type: str | None = None) -> Event:
    """The one terminal event of a failed job. Readers drop an event at or below the last seq
    of its index, so it takes the next seq of index 0."""
    seq = completions[0].next_seq if completions else 0
    return Event(seq=seq, error=error, error_type=error_type, index=0)


class JobTable:
    """The jobs this worker holds, by job id, with lookups by entry id and engine request id.
    Touched only from the event loop."""

    def __init__(self) -> None:
        self._jobs: dict[str, HeldJob] = {}
        self._by_entry: dict[str, str] = {}
        self._by_engine_id: dict[str, tuple[str, int | None]] = {}  # -> (job id, fixed index)
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[HeldJob]:
        return iter(list(self._jobs.values()))

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def add(self, held: HeldJob) -> None:
        self._jobs[held.id] = held
        self._by_entry[held.entry_id] = held.id

    def get(self, job_id: str) -> HeldJob | None:
        return self._jobs.get(job_id)

    def by_entry(self, entry_id: str) -> HeldJob | None:
        job_id = self._by_entry.get(entry_id)
        return None if job_id is None else self._jobs.get(job_id)

    def new_engine_id(self, held: HeldJob, index: int | None = None) -> str:
        """A fresh engine request id for the job; `index` set: the request runs that one
        completion (a resumed n > 1 job). Ids are never reused, so a job that comes back
        (released, then reclaimed by this worker) cannot collide with its aborted self."""
        engine_id = f"{held.id}~{next(self._counter)}"
        held.engine_ids.add(engine_id)
        self._by_engine_id[engine_id] = (held.id, index)
        return engine_id

    def by_engine_id(self, engine_id: str) -> tuple[HeldJob, int | None] | None:
        found = self._by_engine_id.get(engine_id)
        if found is None or found[0] not in self._jobs:
            return None
        return self._jobs[found[0]], found[1]

    def engine_done(self, held: HeldJob, engine_id: str) -> None:
        held.engine_ids.discard(engine_id)
        self._by_engine_id.pop(engine_id, None)

    def remove(self, held: HeldJob) -> None:
        if self._jobs.get(held.id) is held:
            del self._jobs[held.id]
        if self._by_entry.get(held.entry_id) == held.id:
            del self._by_entry[held.entry_id]
        for engine_id in held.engine_ids:
            self._by_engine_id.pop(engine_id, None)
