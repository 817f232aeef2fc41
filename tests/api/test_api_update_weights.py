"""SGLang's POST /update_weights_from_disk under GENQ_SERVER_DEV_MODE: every worker of the model
serves the new checkpoint by the time it answers (the very next request's tokens are the
offline engine's on that checkpoint, whatever the prefix cache held), a worker that starts
later serves it too, and a checkpoint a worker cannot read is refused by name and taken back
(the workers that could serve the weights before it again)."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from api.settings import Settings
from producer.client import Client
from producer.protocol import Keys
from producer.records import WorkerInfo, decode_worker_info
from producer.redis_server import RedisServer
from producer.sampling_params import SamplingParams
from worker import LLM

PROMPT = list(range(5, 41))  # (two full blocks, cached by the first request)
LONG = 600  # tokens: a request that runs for seconds


def stream_text(oai: openai.OpenAI, model: str) -> str:
    stream = oai.completions.create(model=model, prompt=PROMPT, max_tokens=LONG, temperature=0.0, stream=True,
                                    extra_body={"ignore_eos": True})
    return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)


def the_worker(conn: redis.Redis) -> str:
    """The name of the module's one worker."""
    (worker,) = [key.decode().rsplit(":", 1)[1] for key in conn.keys(Keys().worker("*"))]
    return worker


def beat_of(conn: redis.Redis, worker: str) -> WorkerInfo:
    """What the worker's last heartbeat says."""
    return decode_worker_info(conn.hgetall(Keys().worker(worker)))


def running(conn: redis.Redis, worker: str) -> bool:
    return beat_of(conn, worker).running > 0


@pytest.fixture(scope="module")
def live_worker(stack_redis: RedisServer, tiny_llama_dir: Path, run_worker, tmp_path_factory) -> Iterator[str]:
    with run_worker(stack_redis.url, tiny_llama_dir, tmp_path_factory.mktemp("worker")) as url:
        yield url


@functools.cache
def offline_llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64)


def offline(model_dir: Path, max_tokens: int = 8) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return offline_llm(model_dir).generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0].text


def test_the_workers_serve_the_new_weights_and_a_bad_checkpoint_is_refused(
        served_model: str, oai: openai.OpenAI, live_worker: str, serve_api, run_worker, poll, tiny_llama_dir: Path,
        retrained_llama_dir: Path, tiny_mistral_dir: Path, tmp_path: Path) -> None:
    def served() -> str:
        return oai.completions.create(model=served_model, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                      extra_body={"ignore_eos": True}).choices[0].text

    conn = redis.Redis.from_url(live_worker)
    worker = the_worker(conn)
    old, new = offline(tiny_llama_dir), offline(retrained_llama_dir)
    assert served() == old != new
    body = {"model_path": str(retrained_llama_dir)}
    with serve_api(Settings(redis_url=live_worker)) as url:
        assert httpx.post(f"{url}/update_weights_from_disk", json=body).status_code == 404
    with serve_api(Settings(redis_url=live_worker, server_dev_mode=True)) as url:
        answer = httpx.post(f"{url}/update_weights_from_disk", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json() | {"message": ""} == {"success": True, "message": "", "model": served_model,
                                                   "model_path": str(retrained_llama_dir), "weights_update": 1}
        assert served() == new  # the very next request, its prompt computed again
        # a checkpoint of another shape: the worker names why, serves on what it had, and the
        # update is taken back, so a worker that starts later serves the weights before it
        refused = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(tiny_mistral_dir)},
                             timeout=60)
        assert refused.status_code == 400
        message = refused.json()["error"]["message"]
        assert f"Worker {worker} cannot serve the weights of {tiny_mistral_dir}" in message
        assert "num_key_value_heads 4 (served: 2)" in message and "taken back" in message
        assert served() == new
        assert conn.hget(Keys().weights(served_model), "model_path").decode() == str(retrained_llama_dir)
        # mode "wait" (the default): a request running when an update comes ends on the weights it
        # began with, and the update answers after it
        streamed: dict[str, object] = {}

        def stream_long() -> None:
            streamed["text"] = stream_text(oai, served_model)
            streamed["ended"] = time.monotonic()

        long = threading.Thread(target=stream_long)
        long.start()
        poll(lambda: running(conn, worker), 30, "the long request running")
        asked = time.monotonic()
        back = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(tiny_llama_dir)}, timeout=60)
        long.join(60)
        assert back.status_code == 200 and streamed["ended"] > asked  # (it was asked while the request ran)
        assert streamed["text"] == offline(retrained_llama_dir, LONG)
        assert served() == old
        for wrong, status, named in (({"model_path": "/x", "model": "nope"}, 404, "nope"),
                                     ({"model_path": "/x", "modes": "keep"}, 400, "modes"),
                                     ({"model_path": "/x", "mode": "abort"}, 400, "mode")):
            answer = httpx.post(f"{url}/update_weights_from_disk", json=wrong)
            assert answer.status_code == status and named in answer.json()["error"]["message"], answer.text
    with run_worker(live_worker, retrained_llama_dir, tmp_path, name="late"):  # (started on other weights)
        info = beat_of(conn, "late")
        assert (info.weights_update, info.weights_path, info.weights_error) == (3, str(tiny_llama_dir), "")
    # all or nothing: where one worker cannot serve the update (here, one of another shape under
    # the same name), the workers that could serve the weights before it again
    with run_worker(live_worker, tiny_mistral_dir, tmp_path, name="odd"), \
            serve_api(Settings(redis_url=live_worker, server_dev_mode=True)) as url:
        answer = httpx.post(f"{url}/update_weights_from_disk", json=body, timeout=60)
        assert answer.status_code == 400
        message = answer.json()["error"]["message"]
        assert f"Worker odd cannot serve the weights of {retrained_llama_dir}" in message and "taken back" in message
        assert f"Workers {worker} serve {tiny_llama_dir} again." in message, message
        info = beat_of(conn, worker)
        assert (info.weights_update, info.weights_path, info.weights_error) == (5, str(tiny_llama_dir), "")
        assert conn.hget(Keys().weights(served_model), "model_path").decode() == str(tiny_llama_dir)
    assert served() == old


def test_a_sleeping_worker_takes_no_job_until_it_wakes(live_worker: str, serve_api, poll, run_worker,
                                                      tiny_llama_dir: Path, tmp_path: Path) -> None:
    """vLLM's POST /sleep and /wake_up for every worker of the model: a job sent while it sleeps
    waits in the queue (beats go by, and it is still queued), and runs once it wakes, on the
    weights it served before. A worker that starts meanwhile reads the command (and a pause)
    with its model, and sleeps (and is paused) too; told of the resume, it acts on it at once,
    not at its next heartbeat."""
    conn = redis.Redis.from_url(live_worker)
    worker = the_worker(conn)
    beat = functools.partial(beat_of, conn, worker)

    with serve_api(Settings(redis_url=live_worker, server_dev_mode=True)) as url, httpx.Client(base_url=url) as http:
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert http.post("/sleep", params={"level": 2}, timeout=60).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": True} and beat().free_slots == 0
        assert "genq:num_workers_sleeping 1.0" in http.get("/metrics").text
        job = http.post("/v1/jobs", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0,
                                          "ignore_eos": True}).json()["id"]
        sent = time.time()
        poll(lambda: beat().heartbeat_at > sent + 1.0, 30, "two beats after the job")  # (0.5 s a beat)
        assert http.get(f"/v1/jobs/{job}").json()["status"] == "queued"
        assert http.post("/pause", timeout=60).status_code == 200  # (paused as well, for the late worker)
        slow = ("--heartbeat-s", "30", "--claim-idle-s", "60")  # (told of a command, it beats at once)
        with run_worker(live_worker, tiny_llama_dir, tmp_path, slow, name="late"):
            late = beat_of(conn, "late")
            assert (late.sleep_level, late.paused, late.free_slots) == (2, 1, 0)
            # (its next heartbeat is 30 s away: within 20 s it acted on the message; 10 s ran out once
            # with the whole suite on the 2 cores)
            assert http.post("/resume", timeout=20).status_code == 200
            assert beat_of(conn, "late").paused == 0
        assert http.get(f"/v1/jobs/{job}").json()["status"] == "queued"
        assert http.post("/wake_up", params={"tags": "weights"}, timeout=60).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}  # (its KV cache still sleeps)
        assert http.post("/wake_up", params={"tags": "kv_cache"}, timeout=60).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        view = poll(lambda: (v := http.get(f"/v1/jobs/{job}").json())["status"] == "finished" and v, 60, "the job")
        assert view["outputs"][0]["text"] == offline(Path(beat().weights_path))
        assert http.post("/sleep", params={"level": 3}).status_code == 400
        # weights a level-2 sleep forgot, whose checkpoint is gone by the time they wake: a 500
        # naming the worker, which sleeps on until a weights update brings weights back
        served = beat().weights_path
        moved = shutil.copytree(tiny_llama_dir, tmp_path / "checkpoint")
        assert http.post("/update_weights_from_disk", json={"model_path": str(moved)}, timeout=60).status_code == 200
        assert http.post("/sleep", params={"level": 2}, timeout=60).status_code == 200
        shutil.rmtree(moved)
        failed = http.post("/wake_up", timeout=60)
        assert failed.status_code == 500 and f"Workers {worker} could not wake" in failed.json()["error"]["message"]
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        assert http.post("/update_weights_from_disk", json={"model_path": served}, timeout=60).status_code == 200
        assert http.post("/wake_up", params={"tags": "kv_cache"}, timeout=60).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}


def test_a_pause_aborts_waits_for_or_freezes_the_running_jobs(live_worker: str, serve_api, poll,
                                                               retrained_llama_dir: Path) -> None:
    """vLLM's POST /pause, /resume and GET /is_paused for every worker of the model: paused, it
    takes no jobs (one sent meanwhile stays queued until the resume); the running one ends
    with finish_reason abort before the answer (mode abort, the default), runs to its end
    before it (wait), or stays frozen, its tokens counted no further (keep): a frozen job
    can still be cancelled, a weights update is made at once, and after the resume the job goes
    on over the new weights."""
    conn = redis.Redis.from_url(live_worker)
    worker = the_worker(conn)
    beat = functools.partial(beat_of, conn, worker)

    with serve_api(Settings(redis_url=live_worker, server_dev_mode=True)) as url, httpx.Client(base_url=url) as http:
        def send(max_tokens: int = LONG) -> str:
            return str(http.post("/v1/jobs", json={"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
                                                   "ignore_eos": True}).json()["id"])

        def view(job: str) -> dict[str, Any]:
            return dict(http.get(f"/v1/jobs/{job}").json())

        def started(job: str) -> bool:
            """Running, with its first tokens out: a pause before them would abort it with none
            (a job is running from when its worker takes it)."""
            with Client(live_worker) as client:
                return view(job)["status"] == "running" and bool(client.inspect(job)["events"])

        def beats_go_by() -> WorkerInfo:
            since = time.time()
            return poll(lambda: (info := beat()).heartbeat_at > since + 1.0 and info, 30, "two beats")  # (0.5 s a beat)

        served = beat().weights_path
        whole = offline(Path(served), LONG)
        assert http.get("/is_paused").json() == {"is_paused": False}
        for mode in ("abort", "wait", "keep"):
            job, other = send(), send() if mode == "keep" else ""
            poll(lambda: all(started(j) for j in (job, other) if j), 30, "the long jobs' first tokens")  # noqa: B023
            answer = http.post("/pause", params={"mode": mode} if mode != "abort" else {}, timeout=60)
            assert answer.status_code == 200 and answer.json() == {"status": "paused"}, answer.text
            assert http.get("/is_paused").json() == {"is_paused": True} and beat().free_slots == 0
            assert "genq:num_workers_paused 1.0" in http.get("/metrics").text
            ended = view(job)
            queued = send(8)
            if mode == "abort":
                output = ended["outputs"][0]
                assert (ended["status"], output["finish_reason"]) == ("cancelled", "abort")
                assert 0 < len(output["token_ids"]) < LONG and whole.startswith(output["text"])
                assert conn.hget(Keys().job(job), "abort_reason") == b"paused"
            elif mode == "wait":
                assert ended["status"] == "finished" and ended["outputs"][0]["text"] == whole
            else:
                assert ended["status"] == "running"
                frozen = beat().generation_tokens_total
                assert beats_go_by().generation_tokens_total == frozen and view(job)["status"] == "running"
                assert http.delete(f"/v1/jobs/{other}").status_code == 202
                poll(lambda: view(other)["status"] == "cancelled", 30, "the frozen job cancelled")  # noqa: B023
                update = http.post("/update_weights_from_disk", json={"model_path": str(retrained_llama_dir)},
                                   timeout=60)
                assert update.status_code == 200 and view(job)["status"] == "running", update.text
                with Client(live_worker) as client:  # (what it wrote before the update)
                    before = "".join(event["text"] for event in client.inspect(job)["events"])
            assert view(queued)["status"] == "queued" and beats_go_by().running == (mode == "keep")
            assert view(queued)["status"] == "queued"
            answer = http.post("/resume", timeout=60)
            assert answer.status_code == 200 and answer.json() == {"status": "resumed"}, answer.text
            assert http.get("/is_paused").json() == {"is_paused": False}
            if mode != "keep":
                final = poll(lambda: (v := view(queued))["status"] == "finished" and v, 60, "the job")  # noqa: B023
                assert final["outputs"][0]["text"] == offline(Path(served))
        # (mode keep) the frozen job went on over the new weights, from the tokens it had
        final = poll(lambda: (v := view(job))["status"] == "finished" and v, 60, "the frozen job")
        assert final["outputs"][0]["text"].startswith(before) and final["outputs"][0]["text"] != whole
        assert len(final["outputs"][0]["token_ids"]) == LONG
        new = poll(lambda: (v := view(queued))["status"] == "finished" and v, 60, "the queued job")
        assert new["outputs"][0]["text"] == offline(retrained_llama_dir)
        assert http.post("/update_weights_from_disk", json={"model_path": served}, timeout=60).status_code == 200
        assert http.post("/pause", params={"mode": "stop"}).status_code == 400


def test_genq_weights_sleep_wake_pause_and_resume_from_a_shell(live_worker: str, served_model: str,
                                                               oai: openai.OpenAI, retrained_llama_dir: Path) -> None:
    """The same updates without the API: `genq weights` (mode keep, here), `genq sleep`, `genq wake`,
    `genq pause`, `genq resume`."""
    def genq(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "producer.cli", *args, "--redis-url", live_worker],
                              capture_output=True, text=True, timeout=120)

    done = genq("weights", str(retrained_llama_dir), "--mode", "keep")
    assert done.returncode == 0 and f"serves the weights of {retrained_llama_dir}" in done.stdout, done.stderr
    text = oai.completions.create(model=served_model, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    assert text == offline(retrained_llama_dir)
    conn = redis.Redis.from_url(live_worker)
    worker = the_worker(conn)
    assert genq("sleep", "--level", "1").returncode == 0
    assert beat_of(conn, worker).sleep_level == 1
    woke = genq("wake", "--tags", "kv_cache,weights")
    assert woke.returncode == 0 and "woke kv_cache and weights" in woke.stdout, woke.stderr
    assert beat_of(conn, worker).sleep_level == 0
    paused = genq("pause", "--mode", "keep")
    assert paused.returncode == 0 and "paused (mode keep)" in paused.stdout, paused.stderr
    assert beat_of(conn, worker).paused == 1
    assert f"{worker} " in (status := genq("status").stdout) and " paused " in status, status
    assert genq("resume").returncode == 0
    assert beat_of(conn, worker).paused == 0
