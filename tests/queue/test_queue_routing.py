"""Two models on one Redis: a pool per model, each reading its own queue's stream.

Worker ra serves the tiny Llama from the shared stream (`requests`); worker rb serves the
tiny Mistral from `requests:b`. Clients route a job by its model to the queue its workers
advertise; a job for Mistral put on the shared stream anyway (redis-cli) is forwarded by ra
to rb's stream. Outputs match the offline engine of each model.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import redis
from queue_support import WorkerProcess, wait_for

from producer.client import Client
from producer.jobs import SUBMIT_LUA, build_job, submit_call
from producer.protocol import LANE_HIGH, LANE_NORMAL, JobStatus, Keys, encode_job, split_ref
from producer.records import decode_record, decode_worker_info
from producer.redis_server import free_port
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


def count_of(scraped: str, sample: str) -> float:
    """The value of one sample line of a Prometheus scrape (0 when absent)."""
    return next((float(line.split()[-1]) for line in scraped.splitlines() if line.startswith(sample + " ")), 0.0)


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


@pytest.mark.parametrize(("lane", "priority"), [(LANE_NORMAL, 0), (LANE_HIGH, -2)])
def test_a_job_put_on_the_shared_stream_goes_to_its_models_queue(
    client: Client, conn: redis.Redis, keys: Keys, oracles, lane: str, priority: int
) -> None:
    job = build_job("Forwarded to the Mistral", GREEDY, job_id=f"routed-{priority}", model=MISTRAL)
    job = replace(job, priority=priority)
    shared = keys.on_lane(lane).requests
    conn.xadd(shared, encode_job(job))  # redis-cli XADD: no route, no record yet
    wait_for(lambda: conn.hget(keys.job(job.id), "status") in (b"running", b"finished"), TIMEOUT_S, "job started on b")
    result = client.result(job.id, TIMEOUT_S)
    assert result.status == JobStatus.FINISHED
    assert result.token_ids == oracles(MISTRAL, "Forwarded to the Mistral")
    record = job_record(conn, keys, job.id)
    assert (record.worker, record.queue) == ("rb", "b")
    assert record.entry_id is not None and split_ref(record.entry_id)[1] == lane  # it keeps its lane
    stream, entry_id = keys.on_queue("b").locate(record.entry_id)
    assert stream == keys.on_queue("b").on_lane(lane).requests
    assert conn.xrange(stream, entry_id, entry_id)  # the copy
    assert conn.xpending(shared, keys.group)["pending"] == 0  # the original is acked
    assert client.inspect(job.id)["job"]["prompt"] == "Forwarded to the Mistral"


def test_workers_take_the_high_lane_first_and_the_low_lane_last(
    spawn: Callable[..., WorkerProcess], client: Client, conn: redis.Redis, keys: Keys
) -> None:
    """A backlog waits on queue `lanes`; its one-slot worker starts after it was queued, and
    takes the jobs one at a time: the priority -1 job (queued last) first, the priority 5 job
    after every priority-0 one, whatever their order in time."""
    lanes = keys.on_queue("lanes")
    order = [("n0", 0), ("low", 5), ("n1", 0), ("n2", 0), ("high", -1)]
    submit = conn.register_script(SUBMIT_LUA)
    for job_id, priority in order:
        job = replace(build_job(f"job {job_id}", GREEDY, job_id=f"lane-{job_id}"), priority=priority)
        submit_keys, args = submit_call(lanes, job)
        submit(keys=submit_keys, args=args)
    assert [conn.xlen(s) for s in lanes.lane_streams] == [1, 3, 1]
    port = free_port()
    worker = spawn("rl", GENQ_QUEUE="lanes", GENQ_SERVED_MODEL_NAME="tiny-lanes", GENQ_MAX_NUM_SEQS="1",
                   GENQ_METRICS_PORT=str(port), GENQ_METRICS_HOST="127.0.0.1")
    try:
        results = [client.result(f"lane-{job_id}", TIMEOUT_S) for job_id, _ in order]
        assert all(r.status == JobStatus.FINISHED for r in results)
        started = {job_id: job_record(conn, keys, f"lane-{job_id}").started_at for job_id, _ in order}
        assert sorted(started, key=lambda j: started[j]) == ["high", "n0", "n1", "n2", "low"]
        ref = job_record(conn, keys, "lane-high").entry_id
        assert ref is not None and ref.endswith("@high")
        assert client.inspect("lane-high")["job"]["prompt"] == "job high"
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        waits = {lane: count_of(scraped, f'genq:request_queue_time_seconds_count{{lane="{lane}",model_name="tiny-lanes"}}')
                 for lane in ("high", "normal", "low")}
        assert waits == {"high": 1, "normal": 3, "low": 1}
    finally:
        worker.stop()


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
