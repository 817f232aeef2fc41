"""A worker with GENQ_ASYNC_SCHEDULING=1: each step's outputs are published a step later, made
while the next step runs; its jobs end with what the engine without it gives (stop strings,
n > 1, usage), and the worker streams every job's tokens in order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
from queue_support import WorkerProcess

from producer.client import Client
from producer.protocol import JobStatus
from producer.redis_server import RedisServer
from producer.sampling_params import SamplingParams

TIMEOUT_S = 60.0
PROMPTS = ["Once upon a time", "The capital of France", "def add(a, b):", "Red, green and"]


def test_jobs_end_as_without_it(spawn: Callable[..., WorkerProcess], conn: redis.Redis, redis_server: RedisServer,
                                offline: Any) -> None:
    worker = spawn("as", GENQ_ASYNC_SCHEDULING="1")
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    text = offline(PROMPTS[1], greedy)[0].text  # (the stop job's prompt)
    stop = text[len(text) // 2 : len(text) // 2 + 2].strip() or text[-2:]
    params = [greedy, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop]),
              SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=12, ignore_eos=True), greedy]
    worker.wait_ready(conn)
    with Client(redis_server.url, prefix=worker.keys.prefix) as client:
        jobs = [client.submit(PROMPTS[i % 2], p) for i, p in enumerate(params)]
        results = [job.result(TIMEOUT_S) for job in jobs]
        streamed = list(client.stream(client.submit(PROMPTS[2], greedy).id, TIMEOUT_S))
    for result, p, i in zip(results, params, range(len(params)), strict=True):
        assert result.status == JobStatus.FINISHED, result.error
        expected = offline(PROMPTS[i % 2], p)
        assert [(c.text, c.token_ids, c.finish_reason) for c in result.outputs] == \
            [(c.text, c.token_ids, c.finish_reason) for c in expected]
    assert results[1].outputs[0].finish_reason == "stop"
    assert "512 KV blocks, async scheduling)" in worker.log()
    assert [t for delta in streamed for t in delta.token_ids] == offline(PROMPTS[2], greedy)[0].token_ids
