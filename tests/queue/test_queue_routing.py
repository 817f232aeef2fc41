"""Two models on one Redis: a pool per model, each reading its own queue's stream.

Worker ra serves the tiny Llama from the shared stream (`requests`); worker rb serves the
tiny Mistral from `requests:b`. Clients route a job by its model to the queue its workers
advertise; a job for Mistral put on the shared stream anyway (redis-cli) is forwarded by ra
to rb's stream. Outputs match the offline engine of each model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from queue_support import WorkerProcess, wait_for

from producer.client import Client
from producer.jobs import build_job
from producer.protocol import JobStatus, Keys, encode_job
from producer.records import decode_record, decode_worker_info
from producer.sampling_params import SamplingParams

TIMEOUT_S = 60.0
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
LLAMA, MISTRAL = "tiny-llama", "tiny-mistral"


@pytest.fixture(scope="module")
def workers(spawn: Callable[..., WorkerProcess], conn: redis.Redis,
            tiny_mistral_dir: Path) -> dict[str, WorkerProcess]:
    procs = {
        "ra": spawn("ra", GENQ_SERVED_MODEL_NAME=LLAMA),
        "rb": spawn("rb", GENQ_MODEL=str(tiny_mistral_dir), GENQ_SERVED_MODEL_NAME=MISTRAL,
                    GENQ_QUEUE="b"),
    }
    for proc in procs.values():
        proc.wait_ready(conn)
    return procs


@pytest.fixture
def keys(workers: dict[str, WorkerProcess]) -> Keys:
    return workers["ra"].keys


@pytest.fixture(scope="module")
def oracles(tiny_llama_dir: Path, tiny_mistral_dir: Path) -> Callable[[str, str], list[int]]:
    """`oracles(model, prompt)`: the offline engine's greedy tokens on that model."""
    import torch

    from worker import LLM

    llms = {name: LLM(str(path), dtype="float32", num_gpu_blocks_override=128, max_num_seqs=4)
            for name, path in ((LLAMA, tiny_llama_dir), (MISTRAL, tiny_mistral_dir))}

    def tokens(model: str, prompt: str) -> list[int]:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return llms[model].generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        finally:
            torch.set_num_threads(threads)

    return tokens


def job_record(conn: redis.Redis, keys: Keys, job_id: str):
    return decode_record(conn.hgetall(keys.job(job_id)), job_id)


def test_each_model_runs_on_its_own_queue(client: Client, conn: redis.Redis, keys: Keys, oracles) -> None:
    assert conn.get(keys.route(MISTRAL)) == b"b" and conn.get(keys.route(LLAMA)) == b""
    assert 0 < conn.ttl(keys.route(MISTRAL)) <= 30  # it lapses when rb's beats stop
    assert decode_worker_info(conn.hgetall(keys.worker("rb"))).queue == "b"
    shared_before = conn.xlen(keys.requests)
    prompts = ["The capital of France is", "Once upon a time"]
    results = {model: client.generate(prompts, GREEDY, use_tqdm=False, timeout_s=TIMEOUT_S, model=model)
               for model in (LLAMA, MISTRAL)}
    for model, worker, queue in ((LLAMA, "ra", None), (MISTRAL, "rb", "b")):
        for prompt, result in zip(prompts, results[model], strict=True):
            assert result.status == JobStatus.FINISHED
            assert result.token_ids == oracles(model, prompt), (model, prompt)
            record = job_record(conn, keys, result.id)
            assert (record.worker, record.queue) == (worker, queue)
    assert results[LLAMA][0].token_ids != results[MISTRAL][0].token_ids  # two models indeed
    assert conn.xlen(keys.requests) == shared_before + len(prompts)  # Mistral's went to b
    assert conn.xlen(keys.on_queue("b").requests) >= len(prompts)
    handle = client.submit("no model named", GREEDY)  # the shared stream's model
    assert handle.result(TIMEOUT_S).token_ids == oracles(LLAMA, "no model named")


def test_a_job_put_on_the_shared_stream_goes_to_its_models_queue(
    client: Client, conn: redis.Redis, keys: Keys, oracles
) -> None:
    job = build_job("Forwarded to the Mistral", GREEDY, job_id="routed-1", model=MISTRAL)
    conn.xadd(keys.requests, encode_job(job))  # redis-cli XADD: no route, no record yet
    wait_for(lambda: conn.hget(keys.job(job.id), "status") in (b"running", b"finished"), TIMEOUT_S, "job started on b")
    result = client.result(job.id, TIMEOUT_S)
    assert result.status == JobStatus.FINISHED
    assert result.token_ids == oracles(MISTRAL, "Forwarded to the Mistral")
    record = job_record(conn, keys, job.id)
    assert (record.worker, record.queue) == ("rb", "b")
    assert conn.xrange(keys.on_queue("b").requests, record.entry_id, record.entry_id)  # the copy
    assert conn.xpending(keys.requests, keys.group)["pending"] == 0  # the original is acked
    assert client.inspect(job.id)["job"]["prompt"] == "Forwarded to the Mistral"


def test_a_worker_of_another_model_refuses_the_shared_queue(
    spawn: Callable[..., WorkerProcess], conn: redis.Redis, keys: Keys, tiny_mistral_dir: Path
) -> None:
    wait_for(lambda: any(c["name"] == b"ra" for c in conn.xinfo_consumers(keys.requests, keys.group)),
             TIMEOUT_S, "ra reading the shared stream")
    stray = spawn("rc", GENQ_MODEL=str(tiny_mistral_dir), GENQ_SERVED_MODEL_NAME=MISTRAL)
    assert stray.wait(TIMEOUT_S) != 0
    log = stray.log()
    assert "is read by worker ra, serving 'tiny-llama'" in log and "--queue" in log, log[-2000:]
    assert not conn.exists(keys.worker("rc"))
