"""Redis goes away under a running worker and the API, and comes back: neither is restarted.

The module runs its own Redis with an append-only file (the embedded server's default), a
worker (`arq worker.WorkerSettings`) on the tiny model and the API (`genq api`), each a
process, and kills the server with SIGKILL while jobs are queued and running. Restarted on
the same directory, the server has every job again, and the worker, which kept its engine and
its requests through the outage, finishes them whole: each job's events are the offline
engine's tokens, seq by seq, and so is what each client streaming it through the outage
saw, the Python client's and an OpenAI client's through the API alike.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
from queue_support import (
    LIVE_WORKERS,
    Streams,
    WorkerProcess,
    record,
    tokens_sent,
    wait_for,
    worker_env,
)

from producer.client import Client
from producer.jobs import Delta, JobNotFound
from producer.protocol import EVENT_FIELD, JobStatus, Keys, decode_event
from producer.records import decode_worker_info
from producer.redis_server import RedisServer, free_port
from producer.sampling_params import SamplingParams

PREFIX = "t-outage:"
NUM_JOBS = 24  # over max_num_seqs: some run, the rest wait in the stream
MAX_NUM_SEQS = 8
API_STREAMS = 2  # completions streamed through the API across each outage
TIMEOUT_S = 120.0
NEW_JOBS_WITHIN_S = 30.0  # 24 jobs of 96 tokens on the tiny model take a few seconds
STOP_WITHOUT_REDIS_S = 30.0  # intake's stop, the engine's, the drain's last writes given up
PARAMS = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)


class DurableRedis(RedisServer):
    """The embedded server as `genq redis` runs it (an append-only file in its dir), killed
    and started again on the same port and dir as a crash and a supervisor would."""

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)
        self.process = None


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DurableRedis]:
    with DurableRedis(dir=tmp_path_factory.mktemp("outage-redis"), durable=True) as server:
        yield server


@pytest.fixture(scope="module")
def start_worker(server: DurableRedis, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[Callable[[str], WorkerProcess]]:
    logs = tmp_path_factory.mktemp("outage-logs")
    started: list[WorkerProcess] = []

    def start(name: str) -> WorkerProcess:
        env = worker_env(server.url, tiny_llama_dir, name, PREFIX, GENQ_MAX_NUM_SEQS=str(MAX_NUM_SEQS))
        proc = WorkerProcess(env, logs / f"{name}.log").start()
        started.append(proc)
        LIVE_WORKERS.append(proc)  # a failure's report shows its log
        conn = redis.Redis.from_url(server.url)
        proc.wait_ready(conn)
        conn.close()
        return proc

    start.started = started  # type: ignore[attr-defined]
    yield start
    for proc in started:
        proc.stop()
        LIVE_WORKERS.remove(proc)


@pytest.fixture(scope="module")
def worker(start_worker: Callable[[str], WorkerProcess]) -> WorkerProcess:
    return start_worker("outage")


@pytest.fixture(scope="module")
def api_url(server: RedisServer, worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[str]:
    """`genq api` on the module's Redis and prefix; yields its URL once /health is 200."""
    port = free_port()
    log = tmp_path_factory.mktemp("outage-api") / "api.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "producer.cli", "api", "--redis-url", server.url, "--port", str(port),
             "--prefix", PREFIX, "--log-level", "warning"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: process.poll() is not None or _status(f"{url}/health") == 200, 60.0, "API up")
        assert process.poll() is None, log.read_text()[-3000:]
        yield url
    finally:
        process.terminate()
        process.wait(30)


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2.0).status_code
    except httpx.HTTPError:
        return None


class ApiStreams:
    """Streaming completions through the API with the official OpenAI client, each read in
    its own thread from its request to its end. (While Redis is away a new request is a 503
    with Retry-After: `started` says when each stream has its first chunk.)"""

    def __init__(self, api_url: str, model: str, prompts: list[str]) -> None:
        self.texts: dict[str, str] = {}
        self.started = {prompt: threading.Event() for prompt in prompts}
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._read, args=(api_url, model, p), daemon=True) for p in prompts]
        for thread in self.threads:
            thread.start()

    def _read(self, api_url: str, model: str, prompt: str) -> None:
        try:
            with openai.OpenAI(base_url=f"{api_url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S) as oai:
                stream = oai.completions.create(model=model, prompt=prompt, stream=True, temperature=0.0,
                                                max_tokens=PARAMS.max_tokens, extra_body={"ignore_eos": True})
                pieces = []
                for chunk in stream:
                    self.started[prompt].set()
                    pieces += [choice.text for choice in chunk.choices]
                self.texts[prompt] = "".join(pieces)
        except BaseException as exc:  # reported in the test's thread by join()
            self.errors.append(exc)

    def join(self) -> dict[str, str]:
        for thread in self.threads:
            thread.join(TIMEOUT_S)
        assert not self.errors, self.errors
        return self.texts


@pytest.fixture
def conn(server: DurableRedis) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(server.url)
    yield c
    c.close()


def submit(server: RedisServer, tag: str) -> tuple[list[str], list[str]]:
    prompts = [f"{tag} job {i}" for i in range(NUM_JOBS)]
    with Client(server.url, prefix=PREFIX) as client:
        job_ids = [client.submit(prompt, PARAMS).id for prompt in prompts]
    return job_ids, prompts


def mid_generation(conn: redis.Redis, keys: Keys, job_ids: list[str]) -> bool:
    """Some jobs have streamed a few tokens, none has finished: the kill lands mid-run."""
    lengths = [tokens_sent(conn, keys, job_id) for job_id in job_ids]
    return max(lengths) >= 4


def check_whole(conn: redis.Redis, keys: Keys, job_ids: list[str], prompts: list[str], offline,
                streamed: dict[str, list[Delta]]) -> None:
    """Each job finished with the offline engine's tokens, and its replay log holds them
    all, once each, in seq order; so did what a client streaming it through it all saw."""
    for job_id, completions in zip(job_ids, offline.many(prompts, PARAMS), strict=True):
        expected = completions[0]
        rec = record(conn, keys, job_id)
        assert rec.status == JobStatus.FINISHED, (job_id, rec)
        events = [decode_event(f[EVENT_FIELD.encode()]) for _, f in conn.xrange(keys.events(job_id))]
        for seen in (events, streamed[job_id]):
            assert [e.seq for e in seen] == list(range(len(seen))), job_id  # no gap, no repeat
            assert [t for e in seen for t in e.token_ids] == expected.token_ids, job_id
            assert "".join(e.text for e in seen) == expected.text, job_id


def all_ended(conn: redis.Redis, keys: Keys, job_ids: list[str]) -> bool:
    try:
        return all(record(conn, keys, j).status in (JobStatus.FINISHED, JobStatus.FAILED) for j in job_ids)
    except redis.ConnectionError:
        return False


def outage(server: DurableRedis, worker: WorkerProcess, api_url: str, conn: redis.Redis, tag: str,
           down_s: float, offline) -> None:
    keys = worker.keys
    job_ids, prompts = submit(server, tag)
    streams = Streams(server.url, keys, job_ids)
    api_prompts = [f"{tag} api {i}" for i in range(API_STREAMS)]
    api_streams = ApiStreams(api_url, _served_model(conn, worker), api_prompts)
    wait_for(lambda: mid_generation(conn, keys, job_ids), TIMEOUT_S, "jobs mid-generation")
    wait_for(lambda: all(e.is_set() for e in api_streams.started.values()), TIMEOUT_S, "API streams begun")
    server.kill()
    if down_s > 0:  # the API says Redis is away, and when to try again, rather than hang or die
        away = httpx.get(f"{api_url}/v1/models", timeout=10.0)
        assert away.status_code == 503 and away.json()["error"]["code"] == "redis_unavailable"
        assert int(away.headers["retry-after"]) > 0
    deadline = time.monotonic() + down_s
    while time.monotonic() < deadline:  # the worker must live through the whole outage
        assert worker.process is not None and worker.process.poll() is None, worker.log()[-3000:]
        time.sleep(0.1)  # (polled: the outage's length is the test's input, not a wait)
    server.start()
    wait_for(lambda: all_ended(conn, keys, job_ids), TIMEOUT_S, "every job ended")
    check_whole(conn, keys, job_ids, prompts, offline, streams.join())
    texts = api_streams.join()
    assert [texts[p] for p in api_prompts] == [c[0].text for c in offline.many(api_prompts, PARAMS)]
    assert worker.process is not None and worker.process.poll() is None
    assert _status(f"{api_url}/health") == 200  # the API was not restarted either


def _served_model(conn: redis.Redis, worker: WorkerProcess) -> str:
    return decode_worker_info(conn.hgetall(worker.keys.worker(worker.name)), worker.name).model


def test_redis_killed_and_restarted_at_once(server, worker, api_url, conn, offline) -> None:
    outage(server, worker, api_url, conn, "at once", 0.0, offline)


def test_redis_away_for_30_s(server, worker, api_url, conn, offline) -> None:
    outage(server, worker, api_url, conn, "30 s", 30.0, offline)


def test_events_redis_answered_then_lost_are_written_again(server, worker, conn, offline) -> None:
    """What Redis answered and then lost (a killed master's last writes, which its promoted
    replica never got; a restart's unsynced tail): once Redis is back, the worker writes its
    last seconds again before the rest, and each job's log is whole, every event once."""
    keys = worker.keys
    job_ids, prompts = submit(server, "answered")
    streams = Streams(server.url, keys, job_ids)
    wait_for(lambda: mid_generation(conn, keys, job_ids), TIMEOUT_S, "jobs mid-generation")
    server.kill()
    # the data comes back on another port, out of the worker's reach, and loses the newest two
    # events of each running job, as a promoted replica lacks a master's last writes
    with RedisServer(dir=server.dir, durable=True) as aside:
        side = redis.Redis.from_url(aside.url)
        running = [j for j in job_ids if record(side, keys, j).status == JobStatus.RUNNING]
        for job_id in running:
            newest = side.xrevrange(keys.events(job_id), count=2)
            side.xdel(keys.events(job_id), *[entry_id for entry_id, _ in newest])
        side.close()
    assert running  # (mid-run: some jobs were)
    server.start()
    wait_for(lambda: all_ended(conn, keys, job_ids), TIMEOUT_S, "every job ended")
    check_whole(conn, keys, job_ids, prompts, offline, streams.join())


def test_sigterm_during_an_outage(server, worker, conn, start_worker, offline) -> None:
    """A worker told to stop while Redis is away still stops, within its drain's bounds (no
    grace for jobs whose tokens cannot be written); what it held stays pending, and once
    Redis is back another worker takes it up where its events end."""
    keys = worker.keys
    job_ids, prompts = submit(server, "sigterm")
    streams = Streams(server.url, keys, job_ids)
    wait_for(lambda: mid_generation(conn, keys, job_ids), TIMEOUT_S, "jobs mid-generation")
    server.kill()
    worker.terminate()
    assert worker.wait(STOP_WITHOUT_REDIS_S) == 0, worker.log()[-3000:]
    server.start()
    start_worker("outage-2")
    wait_for(lambda: all_ended(conn, keys, job_ids), TIMEOUT_S, "every job ended")
    check_whole(conn, keys, job_ids, prompts, offline, streams.join())


def test_memory_only_redis_restarted(server, start_worker, api_url, conn, offline) -> None:
    """Redis restarted without its file (a memory-only server): the worker recreates its
    consumer group and serves new jobs within seconds; the jobs it held are gone with the
    data, and a client asking for one is told so, not left waiting: the Python client, and
    an OpenAI client whose stream through the API was under way."""
    worker = next(w for w in reversed(start_worker.started) if w.process.poll() is None)
    keys = worker.keys
    old_ids, _ = submit(server, "forgotten")
    api_streams = ApiStreams(api_url, _served_model(conn, worker), ["forgotten api"])
    wait_for(lambda: mid_generation(conn, keys, old_ids), TIMEOUT_S, "jobs mid-generation")
    wait_for(lambda: api_streams.started["forgotten api"].is_set(), TIMEOUT_S, "API stream begun")
    server.kill()
    with RedisServer(port=server.port) as empty:
        started = time.monotonic()
        job_ids, prompts = submit(empty, "after")
        wait_for(lambda: all_ended(conn, keys, job_ids), TIMEOUT_S, "new jobs ended")
        assert time.monotonic() - started < NEW_JOBS_WITHIN_S
        check_whole(conn, keys, job_ids, prompts, offline, Streams(empty.url, keys, job_ids).join())
        with Client(empty.url, prefix=PREFIX) as client, pytest.raises(JobNotFound, match=old_ids[0]):
            client.result(old_ids[0], 5.0)
        with pytest.raises(AssertionError, match="was lost: its record vanished"):
            api_streams.join()
        assert worker.process.poll() is None
