"""genq clients: submit generation jobs to Redis and follow them to their result.

`Client` (redis-py, blocking) and `AsyncClient` (redis.asyncio) have the same API. The
bookkeeping they share (building jobs, deduplicating events, assembling results) is plain
Python below; each client only adds its own I/O.

Failure handling: `result()` raises `JobFailed` for a failed job; a cancelled job returns a
`JobResult` with `status == JobStatus.CANCELLED`. `generate()` never raises `JobFailed`: failed
jobs come back with `.error` set, so one bad prompt does not lose a whole batch.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, cast

import redis
import redis.asyncio
from tqdm import tqdm

from producer.protocol import (
    CANCEL_FLAG_TTL_S,
    DEFAULT_PREFIX,
    EVENT_FIELD,
    FINISH_ABORT,
    CompletionOutput,
    Event,
    Job,
    JobRecord,
    JobStatus,
    Keys,
    ProtocolError,
    decode_event,
    decode_job,
    decode_record,
    encode_job,
    encode_record,
)
from producer.sampling_params import SamplingParams

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
SUBSCRIBE_CHUNK = 500  # channels per SUBSCRIBE command when following a batch
RECONNECT_ATTEMPTS = 3  # pub/sub reconnects in a row before a stream gives up

PromptInput = str | dict[str, Any] | list[dict[str, Any]]
ParamsInput = SamplingParams | dict[str, Any] | None

# Idempotent submit. KEYS[1]: job hash, KEYS[2]: requests stream.
# ARGV[1]: consumer group, ARGV[2]: number k of entry arguments, ARGV[3 .. 2+k]: entry
# field/value pairs, the rest: job-record field/value pairs. Returns the entry id, or nil if
# the job already exists.
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
local k = tonumber(ARGV[2])
local entry_id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3, 2 + k))
redis.call('HSET', KEYS[1], 'entry_id', entry_id, unpack(ARGV, 3 + k))
return entry_id
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

    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job {job_id} (never submitted, or expired after it ended)")
        self.job_id = job_id


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

    @classmethod
    def from_event(cls, event: Event) -> Delta:
        return cls(
            event.index, event.seq, event.text, list(event.token_ids), event.finished,
            event.finish_reason, event.stop_reason, event.usage, event.logprobs,
            event.prompt_logprobs, event.prompt,
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


# ---------------------------------------------------------------------------------------------
# Shared, I/O-free parts


def build_job(
    prompt: PromptInput,
    sampling_params: ParamsInput = None,
    priority: int = 0,
    job_id: str | None = None,
    deadline_s: float | None = None,
    model: str | None = None,
) -> Job:
    """Validate the inputs of a submit and build its Job; raises ValueError."""
    if deadline_s is not None and (isinstance(deadline_s, bool) or not deadline_s > 0):
        raise ValueError(f"deadline_s must be a positive number of seconds, got {deadline_s!r}")
    if isinstance(sampling_params, dict):
        sampling_params = SamplingParams.from_dict(sampling_params)
    now = time.time()
    job = Job(
        id=uuid.uuid4().hex if job_id is None else job_id,
        sampling_params=sampling_params or SamplingParams(),
        model=model,
        priority=priority,
        deadline=None if deadline_s is None else now + deadline_s,
        submit_time=now,
        **_prompt_fields(prompt),
    )
    job.validate()
    return job


def _prompt_fields(prompt: PromptInput) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list):
        return {"messages": prompt}
    if isinstance(prompt, dict) and len(prompt) == 1 and set(prompt) <= {"prompt", "prompt_token_ids"}:
        return dict(prompt)
    if isinstance(prompt, dict) and "messages" in prompt and set(prompt) <= CHAT_FIELDS:
        return dict(prompt)
    raise ValueError(
        "a prompt is a string, {'prompt': str}, {'prompt_token_ids': [...]}, a list of chat "
        "messages, or {'messages': [...], 'tools': [...], 'chat_template_kwargs': {...}}; "
        f"got {prompt!r:.80}"
    )


CHAT_FIELDS = {"messages", "tools", "chat_template_kwargs"}  # a chat prompt as a mapping


def _batch_jobs(
    prompts: PromptInput | Sequence[PromptInput], params: ParamsInput | Sequence[ParamsInput]
) -> list[Job]:
    """One job per prompt; `params` is one for all or one per prompt (as in LLM.generate)."""
    prompt_list = [prompts] if isinstance(prompts, str) else list(prompts)
    if isinstance(params, Sequence):
        if len(params) != len(prompt_list):
            raise ValueError(f"got {len(params)} sampling params for {len(prompt_list)} prompts")
        return [build_job(p, sp) for p, sp in zip(prompt_list, params, strict=True)]
    return [build_job(p, params) for p in prompt_list]


def _submit_call(keys: Keys, job: Job) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of SUBMIT_LUA for one job."""
    entry = encode_job(job)
    record = encode_record(
        JobRecord(status=JobStatus.QUEUED, n=job.sampling_params.n, submitted_at=job.submit_time)
    )
    args: list[Any] = [keys.group, 2 * len(entry)]
    for mapping in (entry, record):
        for name, value in mapping.items():
            args += [name, value]
    return [keys.job(job.id), keys.requests], args


class _EventLog:
    """One job's events: drops repeats, knows when the job is over, assembles the output."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.n: int | None = None  # read from the job record once subscribed
        self.closed = False  # the record said terminal, yet some events are gone (expired)
        self.error: str | None = None
        self.error_type: str | None = None
        self.usage: dict[str, int] | None = None
        self._last_seq: dict[int, int] = {}
        self._final: dict[int, Event] = {}
        self._text: dict[int, list[str]] = {}
        self._tokens: dict[int, list[int]] = {}

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
        if event.error is not None:
            self.error, self.error_type = event.error, event.error_type
        elif event.finished:
            self._final[event.index] = event
        return True

    @property
    def seen_any(self) -> bool:
        return bool(self._last_seq)

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


class _Follower:
    """The lossless read of many jobs, minus the I/O: SUBSCRIBE every channel and wait for the
    confirmations, then read each record and XRANGE its events in one MULTI, then take the
    channel. Any event lies in the replay, on the channel, or both; `add` drops the doubles.
    Channel messages that arrive before the replay is applied are held back, because applying
    a later seq first would make the replayed earlier ones look like repeats."""

    def __init__(self, keys: Keys, logs: dict[str, _EventLog]) -> None:
        self.logs = logs
        self.by_channel = {keys.events(job_id).encode(): job_id for job_id in logs}

    @property
    def done(self) -> bool:
        return all(log.done for log in self.logs.values())

    def replay(self, job_id: str, raw_record: dict[Any, Any], entries: list[Any]) -> list[Event]:
        log = self.logs[job_id]
        if not raw_record:
            raise JobNotFound(job_id)
        record = decode_record(raw_record, job_id)
        log.n = record.n or 1
        new = [e for e in (_entry_event(f) for _, f in entries) if log.add(e)]
        # Terminal before the XRANGE, yet not all final events were there: they expired.
        # Waiting on the channel would hang, and nothing more will come.
        if record.status is not None and record.status.terminal and not log.done:
            log.closed = True
        return new

    def message(self, message: dict[str, Any]) -> list[tuple[str, Event]]:
        """(job id, event) for a channel message carrying an event not seen yet."""
        job_id = self.by_channel.get(message["channel"])
        if job_id is None or message["type"] != "message":
            return []
        event = decode_event(message["data"])
        return [(job_id, event)] if self.logs[job_id].add(event) else []

    def resubscribed(self, message: dict[str, Any]) -> str | None:
        """The job whose channel was subscribed again. redis-py re-subscribes by itself after
        a reconnect; what was published in the gap is only in the stream, so the caller
        replays that job again (the doubles are dropped as usual)."""
        if message["type"] != "subscribe":
            return None
        return self.by_channel.get(message["channel"])


def _entry_event(entry_fields: dict[bytes, bytes]) -> Event:
    if EVENT_FIELD.encode() not in entry_fields:
        raise ProtocolError(f"events entry has no {EVENT_FIELD!r} field")
    return decode_event(entry_fields[EVENT_FIELD.encode()])


def _count_failure(failures: int, error: redis.ConnectionError) -> int:
    """Pub/sub connection lost: redis-py reconnects on the next read. Give up after a few
    failures in a row: then Redis is really gone."""
    if failures >= RECONNECT_ATTEMPTS:
        raise error
    return failures + 1


class _Deadline:
    def __init__(self, timeout_s: float | None, what: str) -> None:
        self._end = None if timeout_s is None else time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self._what = what

    def remaining(self) -> float | None:
        """Seconds left, or None to wait without limit."""
        return None if self._end is None else max(0.0, self._end - time.monotonic())

    def check(self) -> None:
        if self._end is not None and time.monotonic() >= self._end:
            raise TimeoutError(f"{self._what} did not finish within {self._timeout_s} s")


def _make_result(job_id: str, raw_record: dict[Any, Any], log: _EventLog | None) -> JobResult:
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
    )


def _outputs(record: JobRecord, log: _EventLog | None) -> list[CompletionOutput]:
    """Stored outputs, else the events, else (events expired) the record's readable text."""
    if record.outputs is not None:
        return record.outputs
    if log is not None and log.seen_any:
        return log.outputs()
    if record.text is not None:
        return [CompletionOutput(0, record.text, [], record.finish_reason)]
    return log.outputs() if log is not None else []


def _raise_if_failed(result: JobResult) -> JobResult:
    if result.status == JobStatus.FAILED:
        raise JobFailed(result.id, result.error, result)
    return result


def _is_final(raw_record: dict[Any, Any], job_id: str) -> bool:
    """Terminal with outputs stored: the record alone makes the result."""
    if not raw_record:
        raise JobNotFound(job_id)
    record = decode_record(raw_record, job_id)
    return bool(record.status and record.status.terminal and record.outputs is not None)


def _inspect_view(
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


# ---------------------------------------------------------------------------------------------
# Blocking client


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

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, prefix: str = DEFAULT_PREFIX) -> None:
        self.keys = Keys(prefix)
        self.redis = redis.Redis.from_url(redis_url)
        self._submit_script = self.redis.register_script(SUBMIT_LUA)

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
    ) -> JobHandle:
        """Enqueue one job (once per job id); raises ValueError on invalid input."""
        job = build_job(prompt, sampling_params, priority, job_id, deadline_s, model)
        keys, args = _submit_call(self.keys, job)
        entry_id = self._submit_script(keys=keys, args=args)
        return JobHandle(self, job.id, enqueued=entry_id is not None)

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
        by the message always finds the flag too."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self.keys.cancel_flag(job_id), b"1", ex=CANCEL_FLAG_TTL_S)
        pipe.publish(self.keys.cancel_channel, job_id)
        pipe.execute()

    def stream(self, job_id: str, timeout_s: float | None = None) -> Iterator[Delta]:
        """Every new output of the job, in order, exactly once; raises JobFailed at an error
        event and TimeoutError when `timeout_s` passes before the job ends."""
        for _, event in self._follow({job_id: _EventLog(job_id)}, timeout_s):
            if event.error is not None:
                raise JobFailed(job_id, event.error, error_type=event.error_type)
            yield Delta.from_event(event)

    def result(self, job_id: str, timeout_s: float | None = None) -> JobResult:
        """Wait for the job to end (TimeoutError after `timeout_s`); raises JobFailed."""
        raw = self._hgetall(self.keys.job(job_id))
        if _is_final(raw, job_id):
            return _raise_if_failed(_make_result(job_id, raw, None))
        log = _EventLog(job_id)
        for _ in self._follow({job_id: log}, timeout_s):
            pass
        raw = self._hgetall(self.keys.job(job_id))
        return _raise_if_failed(_make_result(job_id, raw, log))

    def _hgetall(self, key: str) -> dict[bytes, bytes]:
        return cast(dict[bytes, bytes], self.redis.hgetall(key))

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: ParamsInput | Sequence[ParamsInput] = None,
        use_tqdm: bool = True,
        timeout_s: float | None = None,
    ) -> list[JobResult]:
        """Submit a batch in one pipeline, wait for all, return results in input order."""
        jobs = _batch_jobs(prompts, sampling_params)
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            keys, args = _submit_call(self.keys, job)
            self._submit_script(keys=keys, args=args, client=pipe)
        pipe.execute()
        logs = {job.id: _EventLog(job.id) for job in jobs}
        with tqdm(total=len(jobs), disable=not use_tqdm, unit="job", desc="genq") as bar:
            for job_id, _ in self._follow(logs, timeout_s):
                bar.update(int(logs[job_id].done))
            bar.update(len(jobs) - bar.n)
        return self._results(logs)

    def inspect(self, job_id: str) -> dict[str, Any]:
        """The decoded job record, payload and events (what `genq inspect` prints)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hgetall(self.keys.job(job_id))
        pipe.xrange(self.keys.events(job_id))
        pipe.exists(self.keys.cancel_flag(job_id))
        raw, events, cancel = pipe.execute()
        entry_id = raw.get(b"entry_id")
        entry = self.redis.xrange(self.keys.requests, entry_id, entry_id) if entry_id else []
        return _inspect_view(job_id, raw, cast(list[Any], entry), events, bool(cancel))

    def _results(self, logs: dict[str, _EventLog]) -> list[JobResult]:
        pipe = self.redis.pipeline(transaction=False)
        for job_id in logs:
            pipe.hgetall(self.keys.job(job_id))
        return [_make_result(j, raw, logs[j]) for j, raw in zip(logs, pipe.execute(), strict=True)]

    def _follow(
        self, logs: dict[str, _EventLog], timeout_s: float | None
    ) -> Iterator[tuple[str, Event]]:
        """New events of these jobs until all have ended (see `_Follower`)."""
        deadline = _Deadline(timeout_s, f"job {next(iter(logs))}" if len(logs) == 1 else "batch")
        follower = _Follower(self.keys, logs)
        pubsub = self.redis.pubsub()
        try:
            held = self._subscribe(pubsub, list(follower.by_channel), deadline)
            self._on_subscribed(list(logs))
            yield from self._replay(follower, list(logs))
            failures = 0
            while not follower.done:
                try:
                    message = held.pop(0) if held else pubsub.get_message(timeout=deadline.remaining())
                except redis.ConnectionError as exc:
                    failures = _count_failure(failures, exc)
                    continue  # the next read reconnects and re-subscribes; see `resubscribed`
                failures = 0
                if message is None:
                    deadline.check()
                elif (job_id := follower.resubscribed(message)) is not None:
                    yield from self._replay(follower, [job_id])
                else:
                    yield from follower.message(message)
        finally:
            pubsub.close()

    def _subscribe(
        self, pubsub: Any, channels: list[bytes], deadline: _Deadline
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

    def _replay(self, follower: _Follower, job_ids: list[str]) -> Iterator[tuple[str, Event]]:
        pipe = self.redis.pipeline(transaction=True)
        for job_id in job_ids:
            pipe.hgetall(self.keys.job(job_id))
            pipe.xrange(self.keys.events(job_id))
        replies = pipe.execute()
        for i, job_id in enumerate(job_ids):
            for event in follower.replay(job_id, replies[2 * i], replies[2 * i + 1]):
                yield job_id, event


# ---------------------------------------------------------------------------------------------
# asyncio client: the same API, awaited


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

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, prefix: str = DEFAULT_PREFIX) -> None:
        self.keys = Keys(prefix)
        self.redis = redis.asyncio.Redis.from_url(redis_url)
        self._submit_script = self.redis.register_script(SUBMIT_LUA)

    async def aclose(self) -> None:
        await self.redis.aclose()

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
    ) -> AsyncJobHandle:
        job = build_job(prompt, sampling_params, priority, job_id, deadline_s, model)
        keys, args = _submit_call(self.keys, job)
        entry_id = await self._submit_script(keys=keys, args=args)
        return AsyncJobHandle(self, job.id, enqueued=entry_id is not None)

    def job(self, job_id: str) -> AsyncJobHandle:
        return AsyncJobHandle(self, job_id)

    async def status(self, job_id: str) -> JobStatus:
        value = await self.redis.hget(self.keys.job(job_id), "status")
        if value is None:
            raise JobNotFound(job_id)
        return decode_record({b"status": value}, job_id).status or JobStatus.QUEUED

    async def cancel(self, job_id: str) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self.keys.cancel_flag(job_id), b"1", ex=CANCEL_FLAG_TTL_S)
        pipe.publish(self.keys.cancel_channel, job_id)
        await pipe.execute()

    async def stream(self, job_id: str, timeout_s: float | None = None) -> AsyncIterator[Delta]:
        async for _, event in self._follow({job_id: _EventLog(job_id)}, timeout_s):
            if event.error is not None:
                raise JobFailed(job_id, event.error, error_type=event.error_type)
            yield Delta.from_event(event)

    async def result(self, job_id: str, timeout_s: float | None = None) -> JobResult:
        raw = await self.redis.hgetall(self.keys.job(job_id))
        if _is_final(raw, job_id):
            return _raise_if_failed(_make_result(job_id, raw, None))
        log = _EventLog(job_id)
        async for _ in self._follow({job_id: log}, timeout_s):
            pass
        raw = await self.redis.hgetall(self.keys.job(job_id))
        return _raise_if_failed(_make_result(job_id, raw, log))

    async def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: ParamsInput | Sequence[ParamsInput] = None,
        use_tqdm: bool = True,
        timeout_s: float | None = None,
    ) -> list[JobResult]:
        jobs = _batch_jobs(prompts, sampling_params)
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            keys, args = _submit_call(self.keys, job)
            await self._submit_script(keys=keys, args=args, client=pipe)
        await pipe.execute()
        logs = {job.id: _EventLog(job.id) for job in jobs}
        with tqdm(total=len(jobs), disable=not use_tqdm, unit="job", desc="genq") as bar:
            async for job_id, _ in self._follow(logs, timeout_s):
                bar.update(int(logs[job_id].done))
            bar.update(len(jobs) - bar.n)
        pipe = self.redis.pipeline(transaction=False)
        for job_id in logs:
            pipe.hgetall(self.keys.job(job_id))
        return [_make_result(j, raw, logs[j]) for j, raw in zip(logs, await pipe.execute(), strict=True)]

    async def inspect(self, job_id: str) -> dict[str, Any]:
        pipe = self.redis.pipeline(transaction=True)
        pipe.hgetall(self.keys.job(job_id))
        pipe.xrange(self.keys.events(job_id))
        pipe.exists(self.keys.cancel_flag(job_id))
        raw, events, cancel = await pipe.execute()
        entry_id = raw.get(b"entry_id")
        entry = await self.redis.xrange(self.keys.requests, entry_id, entry_id) if entry_id else []
        return _inspect_view(job_id, raw, entry, events, bool(cancel))

    async def _follow(
        self, logs: dict[str, _EventLog], timeout_s: float | None
    ) -> AsyncIterator[tuple[str, Event]]:
        deadline = _Deadline(timeout_s, f"job {next(iter(logs))}" if len(logs) == 1 else "batch")
        follower = _Follower(self.keys, logs)
        pubsub = self.redis.pubsub()
        try:
            held = await self._subscribe(pubsub, list(follower.by_channel), deadline)
            await self._on_subscribed(list(logs))
            async for item in self._replay(follower, list(logs)):
                yield item
            failures = 0
            while not follower.done:
                try:
                    message = (
                        held.pop(0) if held
                        else await pubsub.get_message(timeout=deadline.remaining())
                    )
                except redis.ConnectionError as exc:
                    failures = _count_failure(failures, exc)
                    continue  # the next read reconnects and re-subscribes; see `resubscribed`
                failures = 0
                if message is None:
                    deadline.check()
                elif (job_id := follower.resubscribed(message)) is not None:
                    async for item in self._replay(follower, [job_id]):
                        yield item
                else:
                    for item in follower.message(message):
                        yield item
        finally:
            await pubsub.aclose()

    async def _subscribe(
        self, pubsub: Any, channels: list[bytes], deadline: _Deadline
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
        self, follower: _Follower, job_ids: list[str]
    ) -> AsyncIterator[tuple[str, Event]]:
        pipe = self.redis.pipeline(transaction=True)
        for job_id in job_ids:
            pipe.hgetall(self.keys.job(job_id))
            pipe.xrange(self.keys.events(job_id))
        replies = await pipe.execute()
        for i, job_id in enumerate(job_ids):
            for event in follower.replay(job_id, replies[2 * i], replies[2 * i + 1]):
                yield job_id, event
