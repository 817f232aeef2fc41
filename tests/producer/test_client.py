"""The blocking Client against a real Redis, with FakeWorker as the peer that writes events."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest
import redis

from producer.client import Client
from producer.jobs import JobFailed, JobNotFound
from producer.protocol import CANCEL_FLAG_TTL_S, Event, JobStatus, Keys
from producer.records import JobRecord, decode_record, encode_record
from producer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from conftest import FakeWorker

KEYS = Keys()
RunInThread = Callable[[Callable[[], None]], threading.Thread]


@pytest.fixture
def client(redis_url: str) -> Iterator[Client]:
    with Client(redis_url) as c:
        yield c


# ---------------------------------------------------------------------------------------------
# submit


def test_submit_accepts_every_prompt_shape(client: Client, worker: FakeWorker) -> None:
    messages = [{"role": "user", "content": "hi"}]
    client.submit("plain")
    client.submit({"prompt_token_ids": [1, 2]})
    client.submit({"prompt": "dict"})
    before = time.time()
    client.submit(messages, SamplingParams(n=2), priority=-1, job_id="chat-1", deadline_s=30.0,
                  model="smol")
    client.submit({"messages": messages, "cache_salt": "s1"})  # vLLM's cache_salt beside any prompt form
    client.submit({"prompt_token_ids": [3], "cache_salt": "s2"})
    chat, *jobs = [worker.take() for _ in range(6)]  # priority -1: the high lane, read first
    assert [j.prompt for j in jobs[:3]] == ["plain", None, "dict"]
    assert jobs[1].prompt_token_ids == [1, 2]
    assert [(j.messages, j.prompt_token_ids, j.cache_salt) for j in jobs[3:]] == [(messages, None, "s1"), (None, [3], "s2")]
    assert jobs[0].cache_salt is None
    assert (chat.id, chat.messages, chat.model, chat.priority) == ("chat-1", messages, "smol", -1)
    assert chat.sampling_params.n == 2
    assert chat.deadline is not None and before + 30 <= chat.deadline <= time.time() + 30


@pytest.mark.parametrize(
    ("prompt", "kwargs", "message"),
    [
        ("", {}, "prompt must be a non-empty string"),
        (42, {}, "a prompt is a string"),
        ({"prompt": "a", "prompt_token_ids": [1]}, {}, "a prompt is a string"),
        ({"prompt_token_ids": [-1]}, {}, "prompt_token_ids must be"),
        ([{"content": "no role"}], {}, r"messages\[0\].role"),
        ([], {}, "messages must be a non-empty list"),
        ("a", {"sampling_params": {"top_p": 0}}, "top_p must be in"),
        ("a", {"job_id": "two words"}, "job id"),
        ("a", {"job_id": ""}, "job id"),
        ("a", {"deadline_s": 0}, "deadline_s"),
        ("a", {"priority": 1.5}, "priority must be an integer"),
        ({"prompt": "a", "cache_salt": 7}, {}, "cache_salt must be a non-empty string"),
        ({"cache_salt": "s"}, {}, "a prompt is a string"),
        ({"prompt": "a", "prompt_cache_key": ""}, {}, "prompt_cache_key must be a string of 1 to 1024"),
        ({"prompt": "a", "traceparent": "00-abc-def-01"}, {}, "traceparent must be a W3C traceparent"),
    ],
)
def test_submit_rejects_bad_input(
    client: Client, redis_conn: redis.Redis, prompt: object, kwargs: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        client.submit(prompt, **kwargs)  # type: ignore[arg-type]
    assert redis_conn.xlen(KEYS.requests) == 0


def test_submit_writes_queued_record_and_group(client: Client, redis_conn: redis.Redis) -> None:
    handle = client.submit("hi", SamplingParams(n=3), job_id="j1")
    assert handle.enqueued and handle.status() == JobStatus.QUEUED
    record = decode_record(redis_conn.hgetall(KEYS.job("j1")))
    [(entry_id, _)] = redis_conn.xrange(KEYS.requests)
    assert (record.n, record.entry_id) == (3, entry_id.decode())
    assert record.submitted_at is not None and redis_conn.ttl(KEYS.job("j1")) == -1
    # The group starts at 0, so a worker that arrives later still gets this job.
    [group] = redis_conn.xinfo_groups(KEYS.requests)
    assert group["name"] == KEYS.group.encode() and group["last-delivered-id"] == b"0-0"


def test_submit_is_idempotent(client: Client, redis_conn: redis.Redis) -> None:
    first = client.submit("hi", job_id="same")
    second = client.submit("a different prompt", job_id="same")
    assert (first.enqueued, second.enqueued) == (True, False)
    assert redis_conn.xlen(KEYS.requests) == 1


def test_concurrent_submits_enqueue_once(redis_url: str, redis_conn: redis.Redis) -> None:
    num_threads = 8
    barrier = threading.Barrier(num_threads)
    enqueued: list[bool] = []

    def submit() -> None:
        with Client(redis_url) as c:
            barrier.wait(5.0)
            enqueued.append(c.submit("hi", job_id="race").enqueued)

    threads = [threading.Thread(target=submit) for _ in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10.0)
    assert sorted(enqueued) == [False] * (num_threads - 1) + [True]
    assert redis_conn.xlen(KEYS.requests) == 1


# ---------------------------------------------------------------------------------------------
# stream


def test_stream_replays_a_finished_job(client: Client, worker: FakeWorker) -> None:
    handle = client.submit("hi")
    worker.serve(worker.take(), ["a", "b", "c"])
    deltas = list(handle.stream(timeout_s=5.0))
    assert [(d.seq, d.text, d.token_ids) for d in deltas] == [
        (0, "a", [100]), (1, "b", [101]), (2, "c", [102])
    ]
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"


def test_stream_follows_a_live_job(client: Client, worker: FakeWorker, in_thread: RunInThread) -> None:
    handle = client.submit("hi")

    def serve() -> None:
        job = worker.take()
        worker.wait_subscribed(job.id)
        worker.serve(job, ["x", "y", "z", "!"])

    in_thread(serve)
    start = time.monotonic()
    assert "".join(d.text for d in handle.stream(timeout_s=5.0)) == "xyz!"
    assert time.monotonic() - start < 2.0  # ends at the final event, not at the timeout


class SubscribeHookClient(Client):
    """Runs `hook` between SUBSCRIBE and XRANGE, the window the lossless pattern must cover."""

    def __init__(self, url: str, hook: Callable[[], None]) -> None:
        super().__init__(url)
        self.hook = hook

    def _on_subscribed(self, job_ids: list[str]) -> None:
        self.hook()


def test_stream_is_exactly_once_across_subscribe_replay_window(
    redis_url: str, worker: FakeWorker
) -> None:
    events = worker.token_events(list("abcdefgh"))
    with SubscribeHookClient(redis_url, lambda: worker.emit(job.id, events[2:4])) as client:
        handle = client.submit("hi")
        job = worker.take()
        worker.emit(job.id, events[:2])  # before SUBSCRIBE: only in the replay
        seen = []
        for delta in handle.stream(timeout_s=5.0):  # hook: in the replay and on the channel
            seen.append(delta)
            if delta.seq == 3:
                worker.emit(job.id, events[4:])  # after XRANGE: only on the channel
    assert [d.seq for d in seen] == list(range(8))
    assert "".join(d.text for d in seen) == "abcdefgh"


def test_late_readers_see_every_event_once(redis_url: str, worker: FakeWorker) -> None:
    num_events, num_readers = 1500, 4
    with Client(redis_url) as c:
        job_id = c.submit("hi").id
    seqs: dict[int, list[int]] = {}

    def read(reader: int) -> None:
        # Readers join at different points of the run, while events keep coming.
        worker.wait_for(lambda: worker.redis.xlen(KEYS.events(job_id)) >= reader * 300)
        with Client(redis_url) as c:
            seqs[reader] = [d.seq for d in c.job(job_id).stream(timeout_s=10.0)]

    readers = [threading.Thread(target=read, args=(r,)) for r in range(num_readers)]
    for t in readers:
        t.start()
    events = worker.token_events([f"t{i} " for i in range(num_events)])
    for event in events:
        worker.emit(job_id, [event])
    for t in readers:
        t.join(15.0)
    assert {r: s for r, s in seqs.items()} == {r: list(range(num_events)) for r in range(num_readers)}


@pytest.mark.parametrize("loss", ["connection", "message"])
def test_stream_reads_from_the_log_what_the_channel_lost(client: Client, worker: FakeWorker, loss: str) -> None:
    """The pub/sub connection lost (events published meanwhile reach nobody), or one event
    stored but never relayed (its Redis node died between the two, the replica having it: the
    next message skips its seq): either way the stream reads the log, and misses nothing."""
    handle = client.submit("hi")
    events = worker.token_events(list("abcdef"))
    worker.emit(handle.id, events[:2])
    seen = []
    for delta in handle.stream(timeout_s=5.0):
        seen.append(delta.seq)
        if delta.seq == 1:
            worker.lose(handle.id, events[2], loss)
            worker.emit(handle.id, events[2 if loss == "connection" else 3 :])
    assert seen == list(range(6))


def test_stream_drops_events_a_reclaiming_worker_repeats(client: Client, worker: FakeWorker) -> None:
    handle = client.submit("hi")
    events = worker.token_events(list("abcde"))
    worker.emit(handle.id, events[:3])
    worker.emit(handle.id, events[1:])  # a second worker resumed and re-sent seq 1 and 2
    assert [d.seq for d in handle.stream(timeout_s=5.0)] == [0, 1, 2, 3, 4]


def test_stream_with_n_completions_ends_when_all_finish(client: Client, worker: FakeWorker) -> None:
    handle = client.submit("hi", SamplingParams(n=2))
    job = worker.take()
    first = worker.token_events(["a", "b"], index=0)
    second = worker.token_events(["c", "d", "e"], index=1)
    worker.emit(job.id, [first[0], second[0], first[1], second[1]])  # index 0 done, 1 not yet
    stream = handle.stream(timeout_s=5.0)
    got = [next(stream) for _ in range(4)]
    worker.emit(job.id, [second[2]])
    got += list(stream)
    assert [(d.index, d.text) for d in got] == [(0, "a"), (1, "c"), (0, "b"), (1, "d"), (1, "e")]


def test_stream_raises_on_error_event(client: Client, worker: FakeWorker) -> None:
    handle = client.submit("hi")
    worker.emit(handle.id, worker.token_events(["a"], finish_reason=None))
    worker.fail(handle.id, "CUDA out of memory")
    stream = handle.stream(timeout_s=5.0)
    assert next(stream).text == "a"
    with pytest.raises(JobFailed, match="CUDA out of memory"):
        next(stream)


def test_stream_and_result_time_out(client: Client) -> None:
    handle = client.submit("nobody serves this")
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        handle.result(timeout_s=0.2)
    with pytest.raises(TimeoutError):
        list(handle.stream(timeout_s=0.2))
    assert time.monotonic() - start < 2.0


# ---------------------------------------------------------------------------------------------
# result, status, cancel


def test_result_of_a_live_job(client: Client, worker: FakeWorker, in_thread: RunInThread) -> None:
    handle = client.submit("hi", SamplingParams(n=2))

    def serve() -> None:
        job = worker.take()
        worker.wait_subscribed(job.id)
        worker.serve(job, ["he", "llo"])

    in_thread(serve)
    result = handle.result(timeout_s=5.0)
    assert (result.status, result.text, result.token_ids) == (JobStatus.FINISHED, "hello", [100, 101])
    assert [o.text for o in result.outputs] == ["hello", "hello"]
    assert result.finish_reason == "length"
    assert result.usage == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_result_of_an_ended_job_reads_the_record(
    client: Client, worker: FakeWorker, redis_conn: redis.Redis
) -> None:
    handle = client.submit("hi")
    worker.serve(worker.take(), ["o", "k"])
    redis_conn.delete(KEYS.events(handle.id))  # the record alone must do
    assert handle.result(timeout_s=1.0).text == "ok"


def test_result_when_events_expired_does_not_hang(
    client: Client, redis_conn: redis.Redis
) -> None:
    handle = client.submit("hi")
    record = JobRecord(status=JobStatus.CANCELLED, text="partial", finish_reason="abort")
    redis_conn.hset(KEYS.job(handle.id), mapping=encode_record(record))
    result = handle.result(timeout_s=1.0)
    assert (result.status, result.text, result.finish_reason) == (
        JobStatus.CANCELLED, "partial", "abort"
    )
    # the late stream gets the end from the record: nothing else will come
    [delta] = list(handle.stream(timeout_s=1.0))
    assert (delta.seq, delta.text, delta.finished, delta.finish_reason) == (0, "partial", True, "abort")


def test_result_raises_for_failed_job(client: Client, worker: FakeWorker) -> None:
    handle = client.submit("hi")
    worker.fail(handle.id, "prompt too long")
    with pytest.raises(JobFailed) as info:
        handle.result(timeout_s=5.0)
    assert info.value.error == "prompt too long" and info.value.job_id == handle.id


def test_cancelled_job_result_is_returned(client: Client, worker: FakeWorker) -> None:
    handle = client.submit("hi")
    worker.emit(handle.id, [Event(seq=0, text="pa", token_ids=[1]),
                            Event(seq=1, finished=True, finish_reason="abort")])
    result = handle.result(timeout_s=5.0)  # record still says queued: status from events
    assert (result.status, result.text) == (JobStatus.CANCELLED, "pa")


def test_status_and_unknown_jobs(client: Client, worker: FakeWorker) -> None:
    handle = client.submit("hi")
    assert handle.status() == JobStatus.QUEUED
    worker.start(worker.take().id)
    assert handle.status() == JobStatus.RUNNING
    unknown = client.job("nope")
    for call in (unknown.status, lambda: unknown.result(1.0), lambda: list(unknown.stream(1.0))):
        with pytest.raises(JobNotFound):
            call()


def test_cancel_sets_flag_and_publishes(client: Client, redis_conn: redis.Redis) -> None:
    pubsub = redis_conn.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(KEYS.cancel_channel)
    assert pubsub.get_message(timeout=1.0) is None  # the confirmation
    handle = client.submit("hi")
    handle.cancel()
    assert redis_conn.get(KEYS.cancel_flag(handle.id)) == b"1"
    assert 0 < redis_conn.ttl(KEYS.cancel_flag(handle.id)) <= CANCEL_FLAG_TTL_S
    message = pubsub.get_message(timeout=2.0)
    assert message is not None and message["data"] == handle.id.encode()
    pubsub.close()


# ---------------------------------------------------------------------------------------------
# generate, inspect


def test_generate_returns_results_in_input_order(
    client: Client, worker: FakeWorker, in_thread: RunInThread
) -> None:
    prompts = ["one", "two", "three", "four"]

    def serve_all() -> None:
        for _ in prompts:
            job = worker.take()
            if job.prompt == "three":
                worker.fail(job.id, "bad luck")
            else:
                worker.serve(job, [job.prompt.upper(), "."])  # type: ignore[union-attr]

    in_thread(serve_all)
    results = client.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False, timeout_s=10)
    assert [r.text for r in results] == ["ONE.", "TWO.", "", "FOUR."]
    assert [r.status for r in results].count(JobStatus.FAILED) == 1
    assert results[2].error == "bad luck"


def test_generate_checks_params_per_prompt(client: Client) -> None:
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        client.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_inspect_decodes_everything(client: Client, worker: FakeWorker) -> None:
    handle = client.submit({"prompt_token_ids": [7, 8]}, job_id="look")
    worker.serve(worker.take(), ["a", "b"])
    handle.cancel()
    view = client.inspect("look")
    assert view["record"]["status"] == "finished" and view["record"]["text"] == "ab"
    assert view["job"]["prompt_token_ids"] == [7, 8]
    assert [e["text"] for e in view["events"]] == ["a", "b"]
    assert view["cancel_requested"] is True
    worker.redis.xadd(KEYS.events("look"), {"event": b"\xc1"})
    assert "not valid msgpack" in client.inspect("look")["events"][-1]["protocol_error"]
    assert client.inspect("nope") == {
        "id": "nope", "record": None, "job": None, "events": [], "cancel_requested": False
    }

