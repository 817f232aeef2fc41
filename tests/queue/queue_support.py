"""Helpers for the queue tests: worker subprocesses and polling.

Workers run as real processes (`genq worker` or `arq worker.WorkerSettings`) against
the session's Redis, each under a prefix of its test module, so modules cannot see each
other's keys and nothing needs a FLUSHALL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from producer.client import Client
from producer.jobs import Delta
from producer.protocol import EVENT_FIELD, JobStatus, Keys, decode_event
from producer.records import decode_record
from producer.sampling_params import SamplingParams

# Workers of the module running now: a failing test's report shows their logs, since what a
# worker process did is otherwise invisible (a flake in CI is diagnosed from this alone).
LIVE_WORKERS: list[WorkerProcess] = []
STREAM_TIMEOUT_S = 120.0  # a client stream of a test job, outages included
READY_TIMEOUT_S = 90.0  # a worker imports torch and loads the model (about 5 s alone)
POLL_S = 0.01


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str = "condition") -> Any:
    """Poll `condition` until it returns something truthy; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout_s} s")
        time.sleep(POLL_S)


def worker_env(redis_url: str, model_dir: Path, name: str, prefix: str, **extra: str) -> dict[str, str]:
    """Environment of a test worker: tiny model, small KV pool, short heartbeats and claims."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENQ_")}
    env.update(
        GENQ_REDIS_URL=redis_url,
        GENQ_PREFIX=prefix,
        GENQ_WORKER_NAME=name,
        GENQ_MODEL=str(model_dir),
        GENQ_DTYPE="float32",
        GENQ_NUM_THREADS="1",
        GENQ_NUM_GPU_BLOCKS="512",
        GENQ_HEARTBEAT_S="0.5",
        GENQ_CLAIM_IDLE_S="2",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


class WorkerProcess:
    """One worker subprocess, logging to a file; `via` is "genq" or "arq"."""

    def __init__(
        self, env: dict[str, str], log_path: Path, via: str = "arq", args: tuple[str, ...] = ()
    ) -> None:
        self.env = env
        self.name = env["GENQ_WORKER_NAME"]
        self.keys = Keys(env["GENQ_PREFIX"])
        self.log_path = log_path
        if via == "genq":
            self.argv = [sys.executable, "-m", "producer.cli", "worker", *args]
        else:
            self.argv = [sys.executable, "-m", "arq", "worker.WorkerSettings", *args]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, conn: redis.Redis, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until the worker's heartbeat hash appears (it is then taking jobs)."""

        def ready() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"worker {self.name} exited:\n{self.log()[-3000:]}")
            return bool(conn.exists(self.keys.worker(self.name)))

        wait_for(ready, timeout_s, f"worker {self.name} ready")

    def kill(self) -> None:
        """kill -9: no drain, no cleanup."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def terminate(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout_s)

    def stop(self) -> None:
        """Teardown: SIGTERM, then SIGKILL if it does not exit."""
        if self.process is None or self.process.poll() is not None:
            return
        self.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)


def record(conn: redis.Redis, keys: Keys, job_id: str):
    return decode_record(conn.hgetall(keys.job(job_id)), job_id)


def ended(conn: redis.Redis, keys: Keys, job_id: str) -> bool:
    status = conn.hget(keys.job(job_id), "status")
    return status is not None and JobStatus(status.decode()).terminal


def ghost_takes(conn: redis.Redis, keys: Keys, fields: dict) -> str:
    """XADD an entry and deliver it to a consumer that will never run it, in one MULTI so the
    live worker (blocked in XREADGROUP) cannot get it first; then age it past any claim
    timeout, as if its worker had died long ago. Returns the entry id."""
    pipe = conn.pipeline(transaction=True)
    pipe.xadd(keys.requests, fields)
    pipe.xreadgroup(keys.group, "ghost", {keys.requests: ">"}, count=1)
    entry_id, reply = pipe.execute()
    assert reply[0][1][0][0] == entry_id
    return entry_id.decode()


def age(conn: redis.Redis, keys: Keys, entry_id: str, deliveries: int | None = None) -> None:
    conn.xclaim(keys.requests, keys.group, "ghost", 0, [entry_id], idle=10**9,
                retrycount=deliveries, justid=True)


def tokens_sent(conn: redis.Redis, keys: Keys, job_id: str) -> int:
    """Tokens in a job's events stream so far (workers coalesce a job's steps into fewer
    events: count tokens, not events)."""
    return sum(len(decode_event(f[EVENT_FIELD.encode()]).token_ids) for _, f in conn.xrange(keys.events(job_id)))


def streamed_pieces(tokenizer, params: SamplingParams, token_ids: list[int]) -> list[str]:
    """The text a worker streams for each of these tokens (the engine's detokenizer)."""
    from worker.core.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tokenizer, [], params)
    return [detok.update([t]) for t in token_ids]


class Streams:
    """One client stream per job, each read in its own thread from submit to end."""

    def __init__(self, url: str, keys: Keys, job_ids: list[str]) -> None:
        self.deltas: dict[str, list[Delta]] = {job_id: [] for job_id in job_ids}
        self.errors: list[BaseException] = []
        self.threads = [
            threading.Thread(target=self._read, args=(url, keys, job_id), daemon=True)
            for job_id in job_ids
        ]
        for thread in self.threads:
            thread.start()

    def _read(self, url: str, keys: Keys, job_id: str) -> None:
        try:
            with Client(url, prefix=keys.prefix) as client:
                for delta in client.stream(job_id, STREAM_TIMEOUT_S):
                    self.deltas[job_id].append(delta)
        except BaseException as exc:  # reported in the test's thread by join()
            self.errors.append(exc)

    def join(self) -> dict[str, list[Delta]]:
        for thread in self.threads:
            thread.join(STREAM_TIMEOUT_S)
        assert not self.errors, self.errors
        return self.deltas
