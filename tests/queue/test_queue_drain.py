"""`genq drain NAME` (producer.drain): a worker asked through Redis drains as on SIGTERM: its
running job finishes, it exits 0 and its heartbeat hash goes; a request addressed to another
process of the same name is dropped, and the worker serves on."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import redis
from queue_support import WorkerProcess, wait_for

from producer.client import Client
from producer.protocol import JobStatus, Keys
from producer.redis_server import RedisServer
from producer.sampling_params import SamplingParams

TIMEOUT_S = 60.0


def genq_drain(redis_server: RedisServer, keys: Keys, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "producer.cli", "drain", "--redis-url", redis_server.url,
                           "--prefix", keys.prefix, *args], capture_output=True, text=True, timeout=TIMEOUT_S)


def test_a_worker_asked_to_drain_finishes_its_job_and_stops(
    spawn: Callable[..., WorkerProcess], conn: redis.Redis, redis_server: RedisServer
) -> None:
    worker = spawn("dr")
    worker.wait_ready(conn)
    keys = worker.keys
    conn.set(keys.drain("dr"), "elsewhere:1")  # left for a process that is gone
    wait_for(lambda: not conn.exists(keys.drain("dr")), TIMEOUT_S, "the stale request taken")
    assert "dropped a request to drain worker dr addressed to elsewhere:1" in worker.log()
    assert conn.hget(keys.worker("dr"), "state") == b"serving"

    with Client(redis_server.url, prefix=keys.prefix) as client:
        job = client.submit("Drain me", SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
        wait_for(lambda: conn.hget(keys.job(job.id), "status") == b"running", TIMEOUT_S, "the job running")
        drained = genq_drain(redis_server, keys, "dr")
        result = job.result(TIMEOUT_S)
    assert drained.returncode == 0, drained.stdout + drained.stderr
    assert "asked worker dr" in drained.stdout and "worker dr stopped" in drained.stdout
    assert result.status == JobStatus.FINISHED and len(result.token_ids) == 64
    assert worker.wait(TIMEOUT_S) == 0 and not conn.exists(keys.worker("dr"))
    assert "asked to drain (genq drain)" in worker.log()
    missing = genq_drain(redis_server, keys, "nobody")
    assert missing.returncode == 1 and "no live worker named 'nobody'" in missing.stdout
