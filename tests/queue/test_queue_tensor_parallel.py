"""A worker whose model is split over two ranks (GENQ_TENSOR_PARALLEL_SIZE=2, on CPU): its
engine thread starts the second rank as a process of its own, jobs come out as the offline
engine's, and the rank never outlives its worker, even one killed with SIGKILL."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from queue_support import WorkerProcess, wait_for

from producer.client import Client
from producer.protocol import JobStatus
from producer.sampling_params import SamplingParams

TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def worker(spawn: Callable[..., WorkerProcess], conn: redis.Redis) -> WorkerProcess:
    proc = spawn("tp1", GENQ_TENSOR_PARALLEL_SIZE="2")
    proc.wait_ready(conn)
    return proc


def children(pid: int) -> list[int]:
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir() for child in (task / "children").read_text().split()]


def forkservers(pid: int) -> list[int]:
    return [kid for kid in children(pid) if b"multiprocessing.forkserver" in Path(f"/proc/{kid}/cmdline").read_bytes()]


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_jobs_match_the_offline_engine_and_the_rank_ends_with_its_worker(
    client: Client, offline, worker: WorkerProcess
) -> None:
    prompts = ["The capital of France is", "Once upon a time", "1 2 3"]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    handles = [client.submit(prompt, params) for prompt in prompts]
    results = [handle.result(TIMEOUT_S) for handle in handles]
    assert all(result.status == JobStatus.FINISHED for result in results)
    expected = offline.many(prompts, params)
    assert [r.outputs[0].token_ids for r in results] == [e[0].token_ids for e in expected]
    (server,) = forkservers(worker.pid)
    (rank1,) = children(server)  # the other rank, forked by the worker's forkserver
    assert running(rank1)
    worker.kill()
    for pid, what in ((rank1, "the other rank"), (server, "the forkserver")):
        wait_for(lambda pid=pid: not running(pid), TIMEOUT_S, f"{what}'s exit after its worker's SIGKILL")
