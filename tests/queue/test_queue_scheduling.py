"""The worker's scheduling policy (`--scheduling-policy`, GENQ_SCHEDULING_POLICY): among the
jobs a worker holds, `priority` runs the lowest `priority` value first, `fcfs` the first read.

The lanes (docs/queue.md) only split jobs by the sign of their priority, and only decide what
a worker reads; these jobs are all in the low lane, so the order inside the worker is the
policy's alone. A tiny step budget makes prompts compute one after another, so the order in
which jobs get their (one) token is the order the scheduler admitted them in."""

from __future__ import annotations

from collections.abc import Callable

import redis
from queue_support import WorkerProcess, record, wait_for

from producer.client import Client
from producer.protocol import Keys
from producer.sampling_params import SamplingParams

PROMPT_TOKENS = 96  # with a budget of 4 tokens a step: 24 steps between two jobs' tokens
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
LOW, HIGH = 9, 1  # both > 0: one lane (`@low`), so only the worker's own order differs


def _prompt(job: int) -> dict[str, list[int]]:
    """A prompt of its own (no prefix-cache hit shortens another's)."""
    return {"prompt_token_ids": [100 + job * 7 + i % 5 for i in range(PROMPT_TOKENS)]}


def _finish_order(
    spawn: Callable[..., WorkerProcess], conn: redis.Redis, url: str, name: str, via: str,
    args: tuple[str, ...] = (), **env: str,
) -> tuple[float, list[float]]:
    """Queue a long job, three low-priority ones and then a high-priority one, start a worker
    that holds them all; (the high one's end, the low ones' ends), unix times."""
    keys = Keys(f"t-test_queue_scheduling:{name}:")
    with Client(url, prefix=keys.prefix) as client:
        first = client.submit({"prompt_token_ids": [7] * (4 * PROMPT_TOKENS)}, ONE_TOKEN, priority=LOW)
        lows = [client.submit(_prompt(i), ONE_TOKEN, priority=LOW) for i in range(3)]
        high = client.submit(_prompt(3), ONE_TOKEN, priority=HIGH)
        worker = spawn(name, via, args, GENQ_PREFIX=keys.prefix, GENQ_MAX_NUM_SEQS="5",
                       GENQ_MAX_NUM_BATCHED_TOKENS="4", **env)
        try:
            results = [h.result(timeout_s=120) for h in (first, *lows, high)]
        finally:
            worker.stop()
    assert all(r.token_ids and r.finish_reason == "length" for r in results)
    wait_for(lambda: all(record(conn, keys, h.id).finished_at for h in (*lows, high)), 10, "records")
    ends = [record(conn, keys, h.id).finished_at for h in lows]
    return record(conn, keys, high.id).finished_at, ends


def test_priority_policy_runs_a_later_higher_priority_job_first(spawn, conn, redis_server) -> None:
    high_end, low_ends = _finish_order(spawn, conn, redis_server.url, "prio", "genq",
                                       ("--scheduling-policy", "priority"))
    assert high_end < min(low_ends), (high_end, low_ends)


def test_fcfs_policy_runs_jobs_in_arrival_order(spawn, conn, redis_server) -> None:
    """The default, and the control: the same jobs end in the order they came."""
    high_end, low_ends = _finish_order(spawn, conn, redis_server.url, "fcfs", "arq")
    assert low_ends == sorted(low_ends) and high_end > max(low_ends), (high_end, low_ends)
