"""Several models behind one API: the tiny Llama's worker reads the shared stream, the tiny
Mistral's its own queue (`--queue b`). /v1/models lists both; each request runs on the model
it names (outputs match the offline engine of that model); a request naming none runs on the
shared stream's model."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest

from api.settings import Settings
from producer.protocol import Keys
from producer.records import WorkerInfo, encode_worker_info
from producer.redis_server import RedisServer
from producer.sampling_params import SamplingParams

MISTRAL = "tiny-mistral"
ALIAS = "mistral-alias"  # the Mistral's other name (vLLM's --served-model-name with several)
GREEDY = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def live_worker(stack_redis: RedisServer, tiny_llama_dir: Path, tiny_mistral_dir: Path,
                run_worker, tmp_path_factory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("workers")
    with ExitStack() as stack:
        stack.enter_context(run_worker(stack_redis.url, tiny_llama_dir, logs))
        mistral = ("--queue", "b", "--served-model-name", f"{MISTRAL},{ALIAS}")
        yield stack.enter_context(run_worker(stack_redis.url, tiny_mistral_dir, logs, mistral, name="mistral-worker"))


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path, tiny_mistral_dir: Path, served_model: str):
    """`offline(model, prompt=None)`: the offline engine's greedy text (chat when no prompt)."""
    from worker import LLM

    llms = {served_model: LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64),
            MISTRAL: LLM(str(tiny_mistral_dir), dtype="float32", num_gpu_blocks_override=64)}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def text(model: str, prompt: str | None = None) -> str:
        if prompt is None:
            return llms[model].chat(MESSAGES, params, use_tqdm=False)[0].outputs[0].text
        return llms[model].generate(prompt, params, use_tqdm=False)[0].outputs[0].text

    return text


def test_models_lists_every_pools_model(served_model: str, oai: openai.OpenAI) -> None:
    assert [m.id for m in oai.models.list().data] == [served_model, MISTRAL, ALIAS]  # the shared stream's first
    assert oai.models.retrieve(MISTRAL).id == MISTRAL and oai.models.retrieve(ALIAS).id == ALIAS


def test_each_request_runs_on_the_model_it_names(served_model: str, oai: openai.OpenAI, offline) -> None:
    for model in (served_model, MISTRAL):
        chat = oai.chat.completions.create(model=model, messages=MESSAGES, **GREEDY)
        assert (chat.model, chat.choices[0].message.content) == (model, offline(model))
        chunks = oai.completions.create(model=model, prompt="Once upon", stream=True, **GREEDY)
        assert "".join(c.choices[0].text for c in chunks) == offline(model, "Once upon")
    assert offline(served_model) != offline(MISTRAL)


def test_a_request_naming_an_alias_runs_on_its_model(oai: openai.OpenAI, offline) -> None:
    """The alias routes to the Mistral's queue; the response names the model by its first
    name, as vLLM's does."""
    chat = oai.chat.completions.create(model=ALIAS, messages=MESSAGES, **GREEDY)
    assert (chat.model, chat.choices[0].message.content) == (MISTRAL, offline(MISTRAL))


def test_a_request_naming_no_model_runs_on_the_shared_stream(
    served_model: str, http: httpx.Client, offline
) -> None:
    body = {"messages": MESSAGES, "temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    reply = http.post("/v1/chat/completions", json=body).json()
    assert (reply["model"], reply["choices"][0]["message"]["content"]) == (served_model, offline(served_model))


def test_genq_status_shows_each_queue_and_worker(stack_redis: RedisServer, live_worker: str) -> None:
    out = subprocess.run([sys.executable, "-m", "producer.cli", "status", "--redis-url", stack_redis.url],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()]
    assert ["(shared)", "genq:requests", "0", "0", "0", "0"] in rows and ["b", "genq:requests:b", "0", "0", "0", "0"] in rows
    workers = {row[0]: [*row[1:4], row[4].split("/")[1], row[11]] for row in rows if len(row) == 12 and row[0] != "worker"}
    # (running as running / its max_num_seqs; no weights update yet)
    assert workers == {"api-test": ["tiny-llama", "(shared)", "serving", "8", "-"],
                       "mistral-worker": [MISTRAL, "b", "serving", "8", "-"]}
    assert rows[-1][:3] == ["dead", "letters:", "0"]
    status = json.loads(subprocess.run([sys.executable, "-m", "producer.cli", "status", "--json", "--redis-url",
                                        stack_redis.url], capture_output=True, text=True, timeout=30).stdout)
    assert sorted(w["queue"] for w in status["workers"]) == ["", "b"]


def test_backpressure_counts_every_queue(stack_redis: RedisServer, live_worker: str, serve_api) -> None:
    """Jobs for a model whose pool is stopped wait on that pool's queue, and count against
    GENQ_MAX_QUEUED_JOBS like any other (a beat and a route stand in for a pool that is busy
    loading, so nothing takes them)."""
    import redis

    keys = Keys()
    conn = redis.Redis.from_url(stack_redis.url)
    info = WorkerInfo(model="big-model", max_num_seqs=1, queue="big")
    conn.hset(keys.worker("loading"), mapping=encode_worker_info(info))
    conn.set(keys.route("big-model"), "big")
    try:
        with serve_api(Settings(redis_url=stack_redis.url, max_queued_jobs=2)) as url, \
                httpx.Client(base_url=url) as http:
            for i in range(2):  # the second in the high lane: counted all the same
                job = {"prompt": f"p{i}", "model": "big-model", "priority": -i}
                assert http.post("/v1/jobs", json=job).status_code == 202
            assert [conn.xlen(s) for s in keys.on_queue("big").lane_streams] == [1, 1, 0]
            full = http.post("/v1/jobs", json={"prompt": "one too many", "model": "big-model"})
            assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
            scrape = http.get("/metrics").text
            assert 'genq:queue_depth_by_queue{queue="big"} 2.0' in scrape
            assert 'genq:queue_depth_by_queue{queue=""} 0.0' in scrape and "genq:queue_depth 2.0" in scrape
            assert 'genq:queue_depth_by_lane{lane="high",queue="big"} 1.0' in scrape
            assert 'genq:queue_depth_by_lane{lane="normal",queue="big"} 1.0' in scrape
            status = subprocess.run([sys.executable, "-m", "producer.cli", "status", "--redis-url", stack_redis.url],
                                    capture_output=True, text=True, timeout=30)
            assert ["big", "genq:requests:big", "2", "0", "1", "0"] in [line.split() for line in status.stdout.splitlines()]
    finally:
        conn.delete(keys.worker("loading"), keys.route("big-model"), *keys.on_queue("big").lane_streams)
        conn.close()
