"""A test-side peer for the producer: `FakeWorker` reads jobs and writes events and records
exactly as the protocol tells a worker to (APPEND_EVENTS_LUA, encode_record). It is a fake
peer process, not a mock of producer code: the client under test talks to real Redis."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from producer.protocol import (
    APPEND_EVENTS_LUA,
    EVENT_FIELD,
    EVENTS_TTL_S,
    JOB_TTL_S,
    Event,
    Job,
    JobStatus,
    Keys,
    decode_job,
    encode_event,
)
from producer.records import CompletionOutput, JobRecord, encode_record

POLL_TIMEOUT_S = 5.0


def wait_for(condition: Callable[[], Any], timeout_s: float = POLL_TIMEOUT_S) -> Any:
    """Poll `condition` until it returns something truthy; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.005)
    raise AssertionError(f"condition not met within {timeout_s} s")


def token_events(
    pieces: list[str], index: int = 0, first_seq: int = 0, finish_reason: str | None = "length"
) -> list[Event]:
    """One event per text piece (token id 100 + position); the last one finishes."""
    events = [
        Event(seq=first_seq + i, token_ids=[100 + i], text=piece, index=index)
        for i, piece in enumerate(pieces)
    ]
    if finish_reason is not None:
        last = events[-1]
        last.finished, last.finish_reason = True, finish_reason
        last.usage = {"prompt_tokens": 3, "completion_tokens": len(pieces), "total_tokens": 3 + len(pieces)}
    return events


class FakeWorker:
    """Takes jobs from the requests stream and plays them back as a worker would."""

    token_events = staticmethod(token_events)
    wait_for = staticmethod(wait_for)

    def __init__(self, url: str, keys: Keys | None = None) -> None:
        self.keys = keys or Keys()
        self.redis = redis.Redis.from_url(url)
        self._append = self.redis.register_script(APPEND_EVENTS_LUA)

    def close(self) -> None:
        self.redis.close()

    def take(self, timeout_s: float = POLL_TIMEOUT_S) -> Job:
        """The next job from any priority lane's stream."""
        for stream in self.keys.lane_streams:
            try:
                self.redis.xgroup_create(stream, self.keys.group, id="$", mkstream=True)
            except redis.ResponseError:
                pass  # the producer created it already (at id 0)
        deadline = time.monotonic() + timeout_s
        while True:  # lane by lane, as workers read them
            for stream in self.keys.lane_streams:
                reply = self.redis.xreadgroup(self.keys.group, "fake", {stream: ">"}, count=1)
                if reply:
                    return decode_job(reply[0][1][0][1])
            assert time.monotonic() < deadline, "no job arrived"
            time.sleep(0.01)

    def emit(self, job_id: str, events: list[Event], client: Any = None) -> None:
        args = [EVENTS_TTL_S, *(encode_event(e) for e in events)]
        self._append(keys=[self.keys.events(job_id)], args=args, client=client)

    def start(self, job_id: str) -> None:
        record = JobRecord(status=JobStatus.RUNNING, worker="fake", started_at=time.time())
        self.redis.hset(self.keys.job(job_id), mapping=encode_record(record))

    def finish(self, job_id: str, events: list[Event], record: JobRecord) -> None:
        """Last events and the terminal record in one MULTI, as the worker's Lua call does."""
        pipe = self.redis.pipeline(transaction=True)
        self.emit(job_id, events, client=pipe)
        pipe.hset(self.keys.job(job_id), mapping=encode_record(record))
        pipe.expire(self.keys.job(job_id), JOB_TTL_S)
        pipe.execute()

    def serve(self, job: Job, pieces: list[str]) -> None:
        """Run the whole job: running, one event per piece per completion, finished."""
        self.start(job.id)
        n = job.sampling_params.n
        streams = [token_events(pieces, index=i) for i in range(n)]
        for step in range(len(pieces) - 1):
            self.emit(job.id, [s[step] for s in streams])
        outputs = [
            CompletionOutput(i, "".join(pieces), [100 + k for k in range(len(pieces))], "length")
            for i in range(n)
        ]
        record = JobRecord(
            status=JobStatus.FINISHED, finished_at=time.time(), prompt_tokens=3,
            completion_tokens=n * len(pieces), finish_reason="length", text="".join(pieces),
            outputs=outputs,
        )
        self.finish(job.id, [s[-1] for s in streams], record)

    def fail(self, job_id: str, error: str) -> None:
        record = JobRecord(status=JobStatus.FAILED, error=error, finished_at=time.time())
        self.finish(job_id, [Event(seq=10**6, error=error)], record)

    def lose(self, job_id: str, event: Event, loss: str) -> None:
        """What a channel can lose: `connection` kills the clients' pub/sub connections (what
        is published meanwhile reaches nobody); `message` stores `event` without relaying it
        (its node died between the two, its replica having it)."""
        if loss == "connection":
            assert self.redis.client_kill_filter(_type="pubsub") == 1
        else:
            self.redis.xadd(self.keys.events(job_id), {EVENT_FIELD: encode_event(event)})

    def wait_subscribed(self, job_id: str) -> None:
        """Until a client listens on the job's channel (PUBSUB NUMSUB)."""
        channel = self.keys.events(job_id)
        wait_for(lambda: self.redis.pubsub_numsub(channel)[0][1] > 0)


@pytest.fixture
def worker(redis_url: str) -> Iterator[FakeWorker]:
    fake = FakeWorker(redis_url)
    yield fake
    fake.close()


@pytest.fixture
def in_thread() -> Iterator[Callable[[Callable[[], None]], threading.Thread]]:
    """Run a peer action in a thread; its exceptions fail the test at teardown."""
    threads: list[threading.Thread] = []
    errors: list[BaseException] = []

    def start(action: Callable[[], None]) -> threading.Thread:
        def run() -> None:
            try:
                action()
            except BaseException as exc:  # reported below, in the test's thread
                errors.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        threads.append(thread)
        return thread

    yield start
    for thread in threads:
        thread.join(POLL_TIMEOUT_S)
    assert not errors, errors

