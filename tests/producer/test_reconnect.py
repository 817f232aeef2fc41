"""Followers across a Redis restart: `Client.stream`, `AsyncClient.stream` and the API's relay
against a real redis-server killed (SIGKILL) and started again on the same port.

With an append-only file (fsync always) the server comes back with the job's record and
events: after an outage of OUTAGE_S a follow resumes where it was, every event once, in
order, those written while it was away included. Without persistence the record is gone: the
follow ends with JobLost, saying so, instead of waiting forever. The test plays the worker."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest
import redis

from api.relay import Relay
from producer.async_client import AsyncClient
from producer.client import Client
from producer.jobs import JobLost, JobNotFound
from producer.protocol import APPEND_EVENTS_LUA, EVENTS_TTL_S, Event, JobStatus, Keys, encode_event
from producer.records import CompletionOutput, JobRecord, encode_record
from producer.redis_server import find_redis_server, free_port

PIECES = ["a", "b", "c", "d", "e"]
RESTART_TIMEOUT_S = 20.0
OUTAGE_S = 1.0  # longer than the few quick retries the clients used to give up after


def wait_for(condition: Callable[[], Any], timeout_s: float = RESTART_TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)
    return value


class Peer:
    """The worker's side, written by hand as the protocol says (APPEND_EVENTS_LUA, records)."""

    def __init__(self, url: str) -> None:
        self.keys = Keys()
        self.redis = redis.Redis.from_url(url)
        self._append = self.redis.register_script(APPEND_EVENTS_LUA)

    def emit(self, job_id: str, events: list[Event]) -> None:
        self._append(keys=[self.keys.events(job_id)], args=[EVENTS_TTL_S, *map(encode_event, events)])

    def finish(self, job_id: str, events: list[Event], record: JobRecord) -> None:
        self.emit(job_id, events)
        self.redis.hset(self.keys.job(job_id), mapping=encode_record(record))

    def wait_subscribed(self, job_id: str) -> None:
        wait_for(lambda: self.redis.pubsub_numsub(self.keys.events(job_id))[0][1] > 0)

    def close(self) -> None:
        self.redis.close()


def finished_record() -> JobRecord:
    """The record a worker writes as the job of PIECES ends."""
    text = "".join(PIECES)
    return JobRecord(status=JobStatus.FINISHED, finish_reason="length", text=text,
                     outputs=[CompletionOutput(0, text, [100 + i for i in range(len(PIECES))], "length")])


def token_events(pieces: list[str]) -> list[Event]:
    events = [Event(seq=i, token_ids=[100 + i], text=piece) for i, piece in enumerate(pieces)]
    events[-1].finished, events[-1].finish_reason = True, "length"
    return events


class Server:
    """A redis-server of this test's own, killed and started again on one port and directory."""

    def __init__(self, directory: Path, durable: bool) -> None:
        self.port = free_port()
        self.dir = directory
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if durable else ["--appendonly", "no"]
        self.argv = [find_redis_server(), "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                     *persistence, "--dir", str(directory), "--logfile", str(directory / "redis.log")]
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> Server:
        self.process = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL)
        probe = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0)

        def answers() -> bool:
            assert self.process is not None and self.process.poll() is None, (self.dir / "redis.log").read_text()
            try:
                return bool(probe.ping())
            except redis.ConnectionError:
                return False

        try:
            wait_for(answers, RESTART_TIMEOUT_S)
        finally:
            probe.close()
        return self

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)

    def restart(self, down_s: float) -> None:
        self.kill()
        time.sleep(down_s)  # the outage itself, what is tested (not a wait for something)
        self.start()


@pytest.fixture(params=[True, False], ids=["aof", "memory"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path, durable=request.param).start()
    yield srv
    if srv.process is not None and srv.process.poll() is None:
        srv.kill()


def sync_follow(url: str, job_id: str, seen: list[Any]) -> None:
    with Client(url) as client:
        seen.extend(client.stream(job_id, timeout_s=RESTART_TIMEOUT_S))


async def async_follow(url: str, job_id: str, seen: list[Any]) -> None:
    async with AsyncClient(url) as client:
        async for delta in client.stream(job_id, timeout_s=RESTART_TIMEOUT_S):
            seen.append(delta)


async def relay_follow(url: str, job_id: str, seen: list[Any]) -> None:
    async with AsyncClient(url) as client:
        relay = Relay(client.redis, client.keys)
        await relay.start()
        try:
            async with aclosing(relay.follow([job_id], timeout_s=RESTART_TIMEOUT_S)) as events:
                async for _, event in events:
                    seen.append(event)
        finally:
            await relay.aclose()


FOLLOWERS: dict[str, Callable[[str, str, list[Any]], Any]] = {
    "client": sync_follow, "async_client": async_follow, "relay": relay_follow,
}


def in_thread(follow: Callable[[str, str, list[Any]], Any], url: str, job_id: str) -> tuple[threading.Thread, list, list]:
    """Follow the job in a thread of its own (an event loop for the async ones)."""
    seen: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result = follow(url, job_id, seen)
            if asyncio.iscoroutine(result):
                asyncio.run(result)
        except BaseException as exc:  # looked at by the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, seen, errors


@pytest.mark.parametrize("follower", list(FOLLOWERS))
def test_a_follow_rides_out_a_redis_restart(server: Server, follower: str) -> None:
    durable = "--appendfsync" in server.argv
    with Client(server.url) as client:
        handle = client.submit("hi")
    worker = Peer(server.url)
    events = token_events(PIECES)
    worker.emit(handle.id, events[:2])
    thread, seen, errors = in_thread(FOLLOWERS[follower], server.url, handle.id)
    wait_for(lambda: len(seen) == 2)
    worker.close()
    started = time.monotonic()
    server.restart(OUTAGE_S)
    if not durable:  # the record went with the server: the follow says so, and ends
        thread.join(RESTART_TIMEOUT_S)
        assert not thread.is_alive() and len(errors) == 1 and isinstance(errors[0], JobLost), errors
        assert isinstance(errors[0], JobNotFound) and "was lost" in str(errors[0]) and "restarted" in str(errors[0])
        assert time.monotonic() - started < OUTAGE_S + 10.0
        return
    worker = Peer(server.url)
    worker.emit(handle.id, events[1:3])  # a repeat, then one the follower may not be subscribed for yet
    worker.wait_subscribed(handle.id)  # it came back on its own
    worker.finish(handle.id, events[3:], finished_record())
    worker.close()
    thread.join(RESTART_TIMEOUT_S)
    assert not thread.is_alive() and not errors, errors
    assert [d.seq for d in seen] == [0, 1, 2, 3, 4]
    assert "".join(d.text for d in seen) == "abcde" and seen[-1].finished


def test_the_sse_stream_of_a_job_redis_lost_ends_with_an_error_event(tmp_path: Path) -> None:
    """GET /v1/jobs/<id>/events's stream: an error event naming the loss, then [DONE]."""
    server = Server(tmp_path, durable=False).start()
    try:
        with Client(server.url) as client:
            handle = client.submit("hi")
        Peer(server.url).emit(handle.id, token_events(PIECES)[:1])
        thread, seen, errors = in_thread(sse_follow, server.url, handle.id)
        wait_for(lambda: len(seen) == 1)
        server.restart(0.0)
        thread.join(RESTART_TIMEOUT_S)
    finally:
        server.kill()
    assert not thread.is_alive() and not errors, errors
    assert seen[0].startswith("id: 0\n") and seen[-1] == "data: [DONE]\n\n"
    error = json.loads(seen[1].removeprefix("data: "))
    assert error["error_type"] == "job_lost" and "was lost" in error["error"] and len(seen) == 3


async def sse_follow(url: str, job_id: str, seen: list[Any]) -> None:
    from api.jobs import event_stream

    async with AsyncClient(url) as client:
        relay = Relay(client.redis, client.keys)
        await relay.start()
        try:
            async with aclosing(event_stream(relay, job_id, 1, None, RESTART_TIMEOUT_S)) as stream:
                async for chunk in stream:
                    seen.append(chunk)
        finally:
            await relay.aclose()


@pytest.mark.parametrize("follower", ["client", "async_client"])
def test_a_follow_begun_while_redis_is_away_waits_for_it(tmp_path: Path, follower: str) -> None:
    """A stream started just as Redis went away (its subscription not yet made) waits for
    Redis as one under way does, then reads the job whole."""
    server = Server(tmp_path, durable=True).start()
    try:
        with Client(server.url) as client:
            handle = client.submit("hi")
        worker = Peer(server.url)
        events = token_events(PIECES)
        worker.emit(handle.id, events[:2])
        worker.close()
        server.kill()
        thread, seen, errors = in_thread(FOLLOWERS[follower], server.url, handle.id)
        time.sleep(OUTAGE_S)  # the outage itself, what is tested: the follow begins inside it
        server.start()
        worker = Peer(server.url)
        worker.wait_subscribed(handle.id)
        worker.finish(handle.id, events[2:], finished_record())
        worker.close()
        thread.join(RESTART_TIMEOUT_S)
        assert not thread.is_alive() and not errors, errors
        assert [d.seq for d in seen] == [0, 1, 2, 3, 4] and "".join(d.text for d in seen) == "abcde"
    finally:
        if server.process is not None and server.process.poll() is None:
            server.kill()
