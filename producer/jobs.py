"""What genq's two clients share, with no I/O of its own: building and submitting jobs (the
idempotent SUBMIT script), following their events exactly once (`EventLog`, `Follower`), and
assembling results. `producer.client.Client` (redis-py, blocking) and
`producer.async_client.AsyncClient` (redis.asyncio) each add only their I/O, with the same API.

Failure handling: `result()` raises `JobFailed` for a failed job; a cancelled job returns a
`JobResult` with `status == JobStatus.CANCELLED`. `generate()` never raises `JobFailed`: failed
jobs come back with `.error` set, so one bad prompt does not lose a whole batch.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import redis

from producer.pooling_params import PoolingParams
from producer.protocol import (
    EVENT_FIELD,
    FINISH_ABORT,
    Event,
    Job,
    JobStatus,
    Keys,
    ProtocolError,
    decode_event,
    decode_job,
    encode_job,
    entry_ref,
    lane_of,
    pack_embedding,
    unpack_embedding,
)
from producer.records import CompletionOutput, JobRecord, decode_record, encode_record
from producer.sampling_params import SamplingParams

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
SUBSCRIBE_CHUNK = 500  # channels per SUBSCRIBE command when following a batch
# a follow rides out a Redis outage this long (a restart, a failover) before it gives up, and
# retries in between after this back-off, doubling up to its most
RECONNECT_TIMEOUT_S = 120.0
RECONNECT_BACKOFF_S = (0.05, 2.0)
ROUTE_CACHE_S = 1.0  # how long a client trusts a model's route before reading it again

PromptInput = str | dict[str, Any] | list[dict[str, Any]]
ParamsInput = SamplingParams | dict[str, Any] | None

# Idempotent submit. KEYS[1]: job hash, KEYS[2]: requests stream (of the job's lane).
# ARGV[1]: consumer group, ARGV[2]: the entry_ref suffix of the lane and shard ('', '@<lane>',
# '#<shard>', '@<lane>#<shard>'), ARGV[3]:
# number k of entry arguments, ARGV[4 .. 3+k]: entry field/value pairs, the rest: job-record
# field/value pairs. Returns the entry's ref (protocol.entry_ref), or nil if the job already
# exists.
# Races it prevents, by running as one atomic script:
# - two submits of one job id (a retry after a timeout whose first attempt did land, or two
#   API replicas) both passing an EXISTS check before either writes: the job would be
#   enqueued twice, run twice, and two workers would interleave events on one stream;
# - a worker reading the entry before its `queued` record exists, then having its `running`
#   status overwritten by the submitter's late HSET.
# XADD comes before HSET so a failed XADD leaves no record that would turn retries into no-ops.
# The group is created at id 0 when missing, so jobs enqueued before any worker started are
# delivered even if a worker later creates the group at `$`.
SUBMIT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return false
end
redis.pcall('XGROUP', 'CREATE', KEYS[2], ARGV[1], '0', 'MKSTREAM')
local k = tonumber(ARGV[3])
local ref = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 4, 3 + k)) .. ARGV[2]
redis.call('HSET', KEYS[1], 'entry_id', ref, unpack(ARGV, 4 + k))
return ref
"""


class JobFailed(Exception):
    """The job ended with an error; `.error` is the worker's message, `.error_type`
    ERROR_INVALID_REQUEST when the job itself was at fault (submitting it again cannot help)."""

    def __init__(
        self, job_id: str, error: str | None, result: JobResult | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(f"job {job_id} failed: {error}")
        self.job_id = job_id
        self.error = error
        self.result = result
        self.error_type = error_type or (result.error_type if result else None)


class JobNotFound(LookupError):
    """No record for this job id: never submitted, or expired after it ended."""

    def __init__(self, job_id: str, message: str | None = None) -> None:
        super().__init__(message or f"no job {job_id} (never submitted, or expired after it ended)")
        self.job_id = job_id


class JobLost(JobNotFound):
    """The job's record vanished while it was followed: Redis lost its data (a server
    without persistence restarted, or the keys were deleted). Nothing will finish it."""

    def __init__(self, job_id: str) -> None:
        super().__init__(job_id, f"job {job_id} was lost: its record vanished from Redis while it was followed "
                         "(a Redis without persistence restarted, or the key was deleted); submit it again")


@dataclass(frozen=True)
class Delta:
    """New output of one completion, in order, each exactly once."""

    index: int  # completion index (n > 1)
    seq: int
    text: str  # new text only
    token_ids: list[int]  # new tokens only
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: dict[str, int] | None = None
    logprobs: list[Any] | None = None  # per new token, as protocol.Event carries them
    prompt_logprobs: list[Any] | None = None  # once, on completion 0's first delta
    prompt: str | None = None  # with prompt_logprobs: the prompt as the worker decoded it
    prompt_token_ids: list[int] | None = None  # on each first delta, when the job asked for them

    @classmethod
    def from_event(cls, event: Event) -> Delta:
        return cls(
            event.index, event.seq, event.text, list(event.token_ids), event.finished,
            event.finish_reason, event.stop_reason, event.usage, event.logprobs,
            event.prompt_logprobs, event.prompt, event.prompt_token_ids,
        )


@dataclass
class JobResult:
    """Final state of a job; `text`, `token_ids`, ... are those of completion 0."""

    id: str
    status: JobStatus
    outputs: list[CompletionOutput] = field(default_factory=list)
    usage: dict[str, int] | None = None
    error: str | None = None
    error_type: str | None = None  # with error: ERROR_INVALID_REQUEST, or None
    embedding: list[float] | None = None  # an embedding job's vector

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason if self.outputs else None

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason if self.outputs else None


def build_job(
    prompt: PromptInput,
    sampling_params: ParamsInput = None,
    priority: int = 0,
    job_id: str | None = None,
    deadline_s: float | None = None,
    model: str | None = None,
    pooling_params: PoolingParams | None = None,
    tenant: str | None = None,
    return_prompt_token_ids: bool = False,
) -> Job:
    """Validate the inputs of a submit and build its Job; raises ValueError. With
    `pooling_params` it is an embedding job (the result's `embedding`, no text)."""
    if deadline_s is not None and (isinstance(deadline_s, bool) or not deadline_s > 0):
        raise ValueError(f"deadline_s must be a positive number of seconds, got {deadline_s!r}")
    if isinstance(sampling_params, dict):
        sampling_params = SamplingParams.from_dict(sampling_params)
    now = time.time()
    job = Job(
        id=uuid.uuid4().hex if job_id is None else job_id,
        sampling_params=sampling_params or SamplingParams(),
        model=model,
        pooling_params=pooling_params,
        tenant=tenant,
        return_prompt_token_ids=return_prompt_token_ids,
        priority=priority,
        deadline=None if deadline_s is None else now + deadline_s,
        submit_time=now,
        **_prompt_fields(prompt),
    )
    job.validate()
    return job


def _prompt_fields(prompt: PromptInput) -> dict[str, Any]:
    """The Job fields of a prompt; a prompt mapping may carry vLLM's `cache_salt`, OpenAI's
    `prompt_cache_key` and a W3C `traceparent` beside."""
    if isinstance(prompt, dict) and not PROMPT_SIDE_FIELDS.isdisjoint(prompt):
        rest = {k: v for k, v in prompt.items() if k not in PROMPT_SIDE_FIELDS}
        return {**_prompt_fields(rest), **{k: v for k, v in prompt.items() if k in PROMPT_SIDE_FIELDS}}
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list):
        return {"messages": prompt}
    if isinstance(prompt, dict) and len(prompt) == 1 and set(prompt) <= {"prompt", "prompt_token_ids", "prompt_embeds"}:
        return dict(prompt)
    if isinstance(prompt, dict) and "messages" in prompt and set(prompt) <= CHAT_FIELDS:
        return dict(prompt)
    raise ValueError(
        "a prompt is a string, {'prompt': str}, {'prompt_token_ids': [...]}, {'prompt_embeds': "
        "torch.save's bytes of a tensor}, a list of chat messages, or {'messages': [...], 'tools': "
        "[...], 'chat_template_kwargs': {...}}, each mapping with an optional 'cache_salt', "
        "'prompt_cache_key' and 'traceparent'; "
        f"got {prompt!r:.80}"
    )


CHAT_FIELDS = {"messages", "tools", "chat_template_kwargs"}  # a chat prompt as a mapping
# what any prompt mapping may carry beside (traceparent: W3C trace context, producer.tracing)
PROMPT_SIDE_FIELDS = {"cache_salt", "prompt_cache_key", "traceparent"}


def batch_jobs(
    prompts: PromptInput | Sequence[PromptInput], params: ParamsInput | Sequence[ParamsInput],
    model: str | None = None,
) -> list[Job]:
    """One job per prompt; `params` is one for all or one per prompt (as in LLM.generate)."""
    prompt_list = [prompts] if isinstance(prompts, str) else list(prompts)
    if isinstance(params, Sequence):
        if len(params) != len(prompt_list):
            raise ValueError(f"got {len(params)} sampling params for {len(prompt_list)} prompts")
        return [build_job(p, sp, model=model) for p, sp in zip(prompt_list, params, strict=True)]
    return [build_job(p, params, model=model) for p in prompt_list]


def submit_call(keys: Keys, job: Job) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of SUBMIT_LUA for one job, onto the stream of `keys.queue`'s lane for
    the job's priority, in the job's shard."""
    entry = encode_job(job)
    record = encode_record(JobRecord(
        status=JobStatus.QUEUED, n=job.sampling_params.n, submitted_at=job.submit_time,
        queue=keys.queue or None,
    ))
    lane = lane_of(job.priority)
    keys = keys.for_job(job.id).on_lane(lane)
    args: list[Any] = [keys.group, entry_ref("", lane, keys.shard), 2 * len(entry)]
    for mapping in (entry, record):
        for name, value in mapping.items():
            args += [name, value]
    return [keys.job(job.id), keys.requests], args


def entry_location(keys: Keys, raw: dict[bytes, bytes]) -> tuple[str, str] | None:
    """(stream, entry id) of the entry a job record (HGETALL reply) names; None: none."""
    ref = raw.get(b"entry_id")
    if not ref:
        return None
    return keys.on_queue(raw.get(b"queue", b"").decode()).locate(ref.decode())


class Routes:
    """Which queue serves each model, as its workers advertise it (`route(model)`, refreshed
    every heartbeat), remembered for ROUTE_CACHE_S so a burst of submits reads it once. A
    model no worker advertises goes to the shared stream, whose workers run it or say why
    they cannot."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self._known: dict[str, tuple[float, str]] = {}  # model -> (monotonic time, queue)

    def cached(self, model: str) -> Keys | None:
        """The keys to submit a job for `model` under, when known without asking Redis."""
        hit = self._known.get(model)
        if hit is None or time.monotonic() - hit[0] > ROUTE_CACHE_S:
            return None
        return self.keys.on_queue(hit[1])

    def learn(self, model: str, queue: bytes | None) -> Keys:
        """Remember the reply of GET route(model)."""
        name = queue.decode() if queue else ""
        self._known[model] = (time.monotonic(), name)
        return self.keys.on_queue(name)


class EventLog:
    """One job's events: drops repeats, knows when the job is over, assembles the output."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.n: int | None = None  # read from the job record once subscribed
        self.closed = False  # the record said terminal, yet some events are gone (expired)
        self.error: str | None = None
        self.error_type: str | None = None
        self.usage: dict[str, int] | None = None
        self.embedding: list[float] | None = None
        self._last_seq: dict[int, int] = {}
        self._final: dict[int, Event] = {}
        self._text: dict[int, list[str]] = {}
        self._tokens: dict[int, list[int]] = {}
        self.sparse = False  # a replay found the stream's seqs skipping: no gap is a lost message

    @property
    def done(self) -> bool:
        if self.closed or self.error is not None:
            return True
        return self.n is not None and all(i in self._final for i in range(self.n))

    def add(self, event: Event) -> bool:
        """Record a new event; False for one already seen (replay and channel overlap, or a
        reclaiming worker re-emitting) or one after the job ended."""
        last = self._last_seq.get(event.index)
        if self.done or (last is not None and event.seq <= last):
            return False
        self._last_seq[event.index] = event.seq
        self._text.setdefault(event.index, []).append(event.text)
        self._tokens.setdefault(event.index, []).extend(event.token_ids)
        if event.usage is not None:
            self.usage = event.usage
        if event.embedding is not None:
            self.embedding = unpack_embedding(event.embedding)
        if event.error is not None:
            self.error, self.error_type = event.error, event.error_type
        elif event.finished:
            self._final[event.index] = event
        return True

    def skips(self, event: Event) -> bool:
        """Whether a channel message's event comes after one of its completion's not seen: the
        channel lost one, as when a Redis node died having stored and replicated an event but
        not yet relayed its PUBLISH. (genq's workers number each completion's events 0, 1, 2...)"""
        return not self.sparse and event.seq > self._last_seq.get(event.index, -1) + 1

    @property
    def seen_any(self) -> bool:
        return bool(self._last_seq)

    def catch_up(self, record: JobRecord) -> list[Event]:
        """The job ended and its events are gone (they expire GENQ_EVENTS_RETENTION_S after
        the end): the rest of its output, rebuilt from the record, as new events."""
        sent = {i: (sum(map(len, self._text.get(i, []))), len(self._tokens.get(i, []))) for i in self._last_seq}
        return [e for e in record_ending(record, self._last_seq, set(self._final), sent) if self.add(e)]

    def outputs(self) -> list[CompletionOutput]:
        indices = sorted(set(self._text) | set(range(self.n or 0)))
        return [self._output(i) for i in indices]

    def _output(self, index: int) -> CompletionOutput:
        final = self._final.get(index)
        return CompletionOutput(
            index=index,
            text="".join(self._text.get(index, [])),
            token_ids=list(self._tokens.get(index, [])),
            finish_reason=final.finish_reason if final else None,
            stop_reason=final.stop_reason if final else None,
        )

    def status(self) -> JobStatus:
        if self.error is not None:
            return JobStatus.FAILED
        reasons = {e.finish_reason for e in self._final.values()}
        return JobStatus.CANCELLED if reasons == {FINISH_ABORT} else JobStatus.FINISHED


class Follower:
    """The lossless read of many jobs, minus the I/O: SUBSCRIBE every channel and wait for the
    confirmations, then read each record and XRANGE its events in one MULTI, then take the
    channel. Any event lies in the replay, on the channel, or both; `add` drops the doubles.
    Channel messages that arrive before the replay is applied are held back, because applying
    a later seq first would make the replayed earlier ones look like repeats."""

    def __init__(self, keys: Keys, logs: dict[str, EventLog]) -> None:
        self.logs = logs
        self.by_channel = {keys.events(job_id).encode(): job_id for job_id in logs}

    @property
    def done(self) -> bool:
        return all(log.done for log in self.logs.values())

    def replay(self, job_id: str, raw_record: dict[Any, Any], entries: list[Any]) -> list[Event]:
        log = self.logs[job_id]
        if not raw_record:  # (a first replay: never submitted or expired; a later one: lost)
            raise JobNotFound(job_id) if log.n is None else JobLost(job_id)
        record = decode_record(raw_record, job_id)
        log.n = record.n or 1
        stored = [_entry_event(f) for _, f in entries]
        log.sparse = log.sparse or skips_a_seq(stored)
        new = [e for e in stored if log.add(e)]
        # Terminal before the XRANGE, yet not all final events were there: they expired.
        # Waiting on the channel would hang, and nothing more will come: the record has the rest.
        if record.status is not None and record.status.terminal and not log.done:
            new += log.catch_up(record)
            log.closed = not log.done
        return new

    def message(self, message: dict[str, Any]) -> list[tuple[str, Event]]:
        """(job id, event) for a channel message carrying an event not seen yet."""
        job_id = self.by_channel.get(message["channel"])
        if job_id is None or message["type"] != "message":
            return []
        event = decode_event(message["data"])
        return [(job_id, event)] if self.logs[job_id].add(event) else []

    def skipped(self, message: dict[str, Any]) -> str | None:
        """The job whose event this channel message carries, where one before it was not seen
        (EventLog.skips): the caller replays that job first, then takes the message."""
        job_id = self.by_channel.get(message["channel"])
        if job_id is None or message["type"] != "message":
            return None
        return job_id if self.logs[job_id].skips(decode_event(message["data"])) else None

    def resubscribed(self, message: dict[str, Any]) -> str | None:
        """The job whose channel was subscribed again. redis-py re-subscribes by itself after
        a reconnect; what was published in the gap is only in the stream, so the caller
        replays that job again (the doubles are dropped as usual)."""
        if message["type"] != "subscribe":
            return None
        return self.by_channel.get(message["channel"])


def skips_a_seq(events: list[Event]) -> bool:
    """Whether a stream's events skip a seq of some completion (another producer's numbering)."""
    last: dict[int, int] = {}
    for event in events:
        if event.seq > last.get(event.index, -1) + 1:
            return True
        last[event.index] = max(event.seq, last.get(event.index, -1))
    return False


def record_ending(
    record: JobRecord, last_seq: Mapping[int, int], finished: Collection[int], sent: Mapping[int, tuple[int, int]]
) -> list[Event]:
    """The events a reader is still owed by a job that ended and whose events are gone, from
    its terminal record (which keeps every completion's text and token ids): a failed job's
    error; else, per completion not `finished`, one final event at its next seq with the text
    and tokens after the (characters, tokens) the reader has (`sent`). A completion the reader
    resumed past events it never saw (in `last_seq`, not in `sent`) gets only its end.
    Logprobs and the like lived only in the events."""
    if record.status == JobStatus.FAILED:
        error = record.error or "the job failed (its events expired)"
        return [Event(seq=last_seq.get(0, -1) + 1, error=error, error_type=record.error_type)]
    outputs = {o.index: o for o in _outputs(record, None)}
    if not outputs:  # a record that never stored them (another producer's worker): nothing to rebuild
        return []
    events = []
    for index in range(record.n or 1):
        if index in finished:
            continue
        out = outputs.get(index) or CompletionOutput(index, "", [], None)
        chars, tokens = sent.get(index, (len(out.text), len(out.token_ids)) if index in last_seq else (0, 0))
        events.append(Event(
            seq=last_seq.get(index, -1) + 1, token_ids=out.token_ids[tokens:], text=out.text[chars:], finished=True,
            finish_reason=out.finish_reason or record.finish_reason or FINISH_ABORT, stop_reason=out.stop_reason,
            usage=record.usage, index=index,
            embedding=pack_embedding(record.embedding) if record.embedding is not None and index == 0 else None,
        ))
    return events


def _entry_event(entry_fields: dict[bytes, bytes]) -> Event:
    if EVENT_FIELD.encode() not in entry_fields:
        raise ProtocolError(f"events entry has no {EVENT_FIELD!r} field")
    return decode_event(entry_fields[EVENT_FIELD.encode()])


class Outage:
    """Redis unreachable while following jobs: `failed` says how long to wait before the next
    try (redis-py reconnects, and re-subscribes, on the next read), with back-off, and raises
    once it has lasted `timeout_s`; `ok` after any success ends it."""

    def __init__(self, timeout_s: float = RECONNECT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._since: float | None = None
        self._delay_s = RECONNECT_BACKOFF_S[0]

    def failed(self, error: Exception) -> float:
        """After `error` (one of producer.redis_conn.REDIS_AWAY): seconds to wait."""
        now = time.monotonic()
        if self._since is None:
            self._since, self._delay_s = now, RECONNECT_BACKOFF_S[0]
        elif now - self._since >= self.timeout_s:
            raise redis.ConnectionError(f"Redis unreachable for {now - self._since:.0f} s while following "
                                        f"jobs: {error}") from error
        delay_s, self._delay_s = self._delay_s, min(2 * self._delay_s, RECONNECT_BACKOFF_S[1])
        return delay_s

    def ok(self) -> None:
        self._since = None


class Deadline:
    def __init__(self, timeout_s: float | None, what: str) -> None:
        self._end = None if timeout_s is None else time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self._what = what

    def remaining(self) -> float | None:
        """Seconds left, or None to wait without limit."""
        return None if self._end is None else max(0.0, self._end - time.monotonic())

    def cap(self, delay_s: float) -> float:
        """A wait of `delay_s`, cut to what is left."""
        remaining = self.remaining()
        return delay_s if remaining is None else min(delay_s, remaining)

    def check(self) -> None:
        if self._end is not None and time.monotonic() >= self._end:
            raise TimeoutError(f"{self._what} did not finish within {self._timeout_s} s")


def make_result(job_id: str, raw_record: dict[Any, Any], log: EventLog | None) -> JobResult:
    """The record is authoritative where it has a field; the events fill in the rest."""
    if not raw_record:
        raise JobNotFound(job_id)
    record = decode_record(raw_record, job_id)
    terminal = record.status is not None and record.status.terminal
    status = record.status if terminal or log is None else log.status()
    return JobResult(
        id=job_id,
        status=status or JobStatus.QUEUED,
        outputs=_outputs(record, log),
        usage=record.usage or (log.usage if log else None),
        error=record.error or (log.error if log else None),
        error_type=record.error_type or (log.error_type if log else None),
        embedding=record.embedding if record.embedding is not None else (log.embedding if log else None),
    )


def _outputs(record: JobRecord, log: EventLog | None) -> list[CompletionOutput]:
    """Stored outputs, else the events, else (events expired) the record's readable text."""
    if record.outputs is not None:
        return record.outputs
    if log is not None and log.seen_any:
        return log.outputs()
    if record.text is not None:
        return [CompletionOutput(0, record.text, [], record.finish_reason)]
    return log.outputs() if log is not None else []


def raise_if_failed(result: JobResult) -> JobResult:
    if result.status == JobStatus.FAILED:
        raise JobFailed(result.id, result.error, result)
    return result


def is_final(raw_record: dict[Any, Any], job_id: str) -> bool:
    """Terminal with outputs stored: the record alone makes the result."""
    if not raw_record:
        raise JobNotFound(job_id)
    record = decode_record(raw_record, job_id)
    return bool(record.status and record.status.terminal and record.outputs is not None)


def inspect_view(
    job_id: str, raw_record: dict[Any, Any], entry: list[Any], events: list[Any], cancel: bool
) -> dict[str, Any]:
    """Everything known about a job, decoded, as plain JSON-able data."""
    view: dict[str, Any] = {"id": job_id, "record": None, "job": None, "events": []}
    view["cancel_requested"] = cancel
    if raw_record:
        view["record"] = _safe(lambda: _record_dict(decode_record(raw_record, job_id)))
    if entry:
        view["job"] = _safe(lambda: asdict(decode_job(entry[0][1])))
    view["events"] = [_safe(partial(_event_dict, f)) for _, f in events]
    return view


def job_names(keys: Keys, job_id: str, at: tuple[str, str] | None) -> dict[str, str | None]:
    """A job's Redis names, for `genq inspect` to print: what to give `redis-cli -c` (on a
    Redis Cluster they carry the job's shard's hash tag)."""
    return {"record": keys.job(job_id), "events": keys.events(job_id), "cancel": keys.cancel_flag(job_id),
            "entry": f"{at[0]} {at[1]}" if at else None}


def _event_dict(entry_fields: dict[bytes, bytes]) -> dict[str, Any]:
    return asdict(_entry_event(entry_fields))


def _record_dict(record: JobRecord) -> dict[str, Any]:
    out = asdict(record)
    out["status"] = record.status.value if record.status else None
    return out


def _safe(decode: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A view that shows what was undecodable instead of failing the whole inspect."""
    try:
        return decode()
    except ProtocolError as exc:
        return {"protocol_error": str(exc)}
