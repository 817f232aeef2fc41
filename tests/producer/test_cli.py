"""The `genq` command line, run as a subprocess against the test Redis."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from producer.protocol import JobStatus, Keys
from producer.redis_server import free_port

if TYPE_CHECKING:
    from conftest import FakeWorker

KEYS = Keys()
RunInThread = Callable[[Callable[[], None]], object]
GENQ = [sys.executable, "-m", "producer.cli"]
TIMEOUT_S = 30


def genq(*args: str, env_url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "GENQ_REDIS_URL"}
    if env_url is not None:
        env["GENQ_REDIS_URL"] = env_url
    return subprocess.run(
        [*GENQ, *args], capture_output=True, text=True, timeout=TIMEOUT_S, env=env
    )


def test_help_lists_subcommands_without_heavy_imports() -> None:
    out = genq("--help")
    assert out.returncode == 0
    for name in ("redis", "submit", "inspect"):
        assert name in out.stdout
    probe = "import sys, producer.cli; print(sorted({'torch', 'worker'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=TIMEOUT_S).stdout.strip() == "[]"
    assert genq("frobnicate").returncode == 2


def serve_one(worker: FakeWorker, in_thread: RunInThread, pieces: list[str], streamed: bool = False) -> list:
    """In a thread: take the next job and answer it with these text pieces (after the client
    subscribed, when it streams). Returns the list the job lands in."""
    jobs = []

    def serve() -> None:
        jobs.append(worker.take(timeout_s=TIMEOUT_S))
        if streamed:
            worker.wait_subscribed(jobs[0].id)
        worker.serve(jobs[0], pieces)

    in_thread(serve)
    return jobs


def test_submit_prints_final_text(redis_url: str, worker: FakeWorker, in_thread: RunInThread) -> None:
    jobs = serve_one(worker, in_thread, ["Hel", "lo"])
    out = genq("submit", "Say hi", "--redis-url", redis_url, "--max-tokens", "2",
               "--temperature", "0", "--top-p", "0.5", "--seed", "7", "--job-id", "cli-1",
               "--priority", "3")
    assert (out.returncode, out.stdout) == (0, "Hello\n")
    assert "job cli-1" in out.stderr
    job = jobs[0]
    assert (job.id, job.prompt, job.priority) == ("cli-1", "Say hi", 3)
    params = job.sampling_params
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (2, 0.0, 0.5, 7)


def test_submit_takes_any_sampling_params_as_json(
    redis_url: str, worker: FakeWorker, in_thread: RunInThread
) -> None:
    jobs = serve_one(worker, in_thread, ["ok"])
    params = '{"top_k": 40, "stop": ["\\n"], "logit_bias": {"5": -2}, "max_tokens": 9, "seed": 1}'
    out = genq("submit", "x", "--redis-url", redis_url, "--params", params, "--seed", "2")
    assert (out.returncode, out.stdout) == (0, "ok\n"), out.stderr
    got = jobs[0].sampling_params
    assert (got.top_k, got.stop, got.logit_bias, got.max_tokens, got.seed) == (40, ["\n"], {5: -2}, 9, 2)


def test_submit_streams_chat_using_env_url(
    redis_url: str, worker: FakeWorker, in_thread: RunInThread
) -> None:
    jobs = serve_one(worker, in_thread, ["a", "b", "c"], streamed=True)
    out = genq("submit", "hi there", "--chat", "--stream", env_url=redis_url)
    assert (out.returncode, out.stdout) == (0, "abc\n")
    assert jobs[0].messages == [{"role": "user", "content": "hi there"}]


def test_submit_attaches_images_and_clips_to_the_message(
    redis_url: str, worker: FakeWorker, in_thread: RunInThread, tmp_path
) -> None:
    """--image and --audio files go before the text, the image as its bytes, the clip as the
    API queues one: 16-bit mono WAV at 16 kHz (here from a stereo 8 kHz file)."""
    import io
    import wave

    jobs = serve_one(worker, in_thread, ["ok"])
    picture, clip = tmp_path / "a.png", tmp_path / "b.wav"
    picture.write_bytes(b"\x89PNG not really")
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(2)
        writer.setsampwidth(2)
        writer.setframerate(8000)
        writer.writeframes(bytes(4 * 800))  # 0.1 s of silence
    clip.write_bytes(out.getvalue())
    done = genq("submit", "Describe both", "--image", str(picture), "--audio", str(clip), "--redis-url", redis_url)
    assert (done.returncode, done.stdout) == (0, "ok\n"), done.stderr
    [message] = jobs[0].messages
    image, audio, text = message["content"]
    assert (image, text) == ({"type": "image", "image": picture.read_bytes()}, {"type": "text", "text": "Describe both"})
    with wave.open(io.BytesIO(audio["audio"])) as reader:
        assert (reader.getframerate(), reader.getnchannels(), reader.getsampwidth(), reader.getnframes()) == (16000, 1, 2, 1600)
    bad = genq("submit", "x", "--audio", str(picture), "--redis-url", redis_url)
    assert bad.returncode == 1 and f"{picture} is not audio that can be read" in bad.stderr
    missing = genq("submit", "x", "--image", str(tmp_path / "none.png"), "--redis-url", redis_url)
    assert missing.returncode == 1 and "cannot read" in missing.stderr


def test_submit_embed_prints_the_vector(redis_url: str, worker: FakeWorker, in_thread: RunInThread) -> None:
    from producer.protocol import Event, pack_embedding
    from producer.records import JobRecord

    jobs = []

    def serve() -> None:
        jobs.append(worker.take(timeout_s=TIMEOUT_S))
        vector = pack_embedding([0.5, -0.25])
        record = JobRecord(status=JobStatus.FINISHED, finished_at=1.0, embedding=[0.5, -0.25])
        worker.finish(jobs[0].id, [Event(seq=0, finished=True, finish_reason="stop", embedding=vector)], record)

    in_thread(serve)
    out = genq("submit", "a sentence", "--embed", "--max-tokens", "5", env_url=redis_url)
    assert (out.returncode, json.loads(out.stdout)) == (0, [0.5, -0.25]), out.stderr
    assert jobs[0].pooling_params is not None and jobs[0].prompt == "a sentence"


def test_submit_reports_failures(redis_url: str, worker: FakeWorker, in_thread: RunInThread) -> None:
    in_thread(lambda: worker.fail(worker.take(timeout_s=TIMEOUT_S).id, "model not loaded"))
    out = genq("submit", "x", "--redis-url", redis_url)
    assert out.returncode == 1 and "model not loaded" in out.stderr
    out = genq("submit", "x", "--max-tokens", "0", "--redis-url", redis_url)
    assert out.returncode == 1 and "max_tokens must be >= 1" in out.stderr
    out = genq("submit", "x", "--redis-url", f"redis://127.0.0.1:{free_port()}/0")
    assert out.returncode == 1 and "cannot reach Redis" in out.stderr
    out = genq("submit", "x", "--params", '{"top_z": 1}', "--redis-url", redis_url)
    assert out.returncode == 1 and "unknown sampling parameter(s): top_z" in out.stderr
    out = genq("submit", "x", "--params", "[1]", "--redis-url", redis_url)
    assert out.returncode == 2 and "must be a JSON object" in out.stderr


def test_inspect(redis_url: str, worker: FakeWorker) -> None:
    from producer.client import Client

    with Client(redis_url) as client:
        client.submit("look at me", job_id="seen")
    worker.serve(worker.take(), ["o", "k"])
    out = genq("inspect", "seen", "--redis-url", redis_url)
    assert out.returncode == 0, out.stderr
    for text in ("job seen", "status: finished", "prompt: look at me", "events (2):", "#1 [0] 'k'"):
        assert text in out.stdout
    out = genq("inspect", "seen", "--json", "--redis-url", redis_url)
    view = json.loads(out.stdout)
    assert view["record"]["text"] == "ok" and view["job"]["prompt"] == "look at me"
    missing = genq("inspect", "nope", "--redis-url", redis_url)
    assert missing.returncode == 1 and "no job nope" in missing.stderr
    with Client(redis_url) as client:  # the entry trimmed, as workers do after the retention
        client.redis.xdel(client.keys.requests, view["record"]["entry_id"])
    out = genq("inspect", "seen", "--redis-url", redis_url)
    assert out.returncode == 0 and "payload: (gone: workers trim" in out.stdout and "status: finished" in out.stdout


def test_dead_lists_and_retries(redis_url: str, worker: FakeWorker) -> None:
    """`genq dead ls` prints each dead letter; `retry` sends a failed job's entry back to the
    queue (a worker takes it again) and leaves what cannot run."""
    from producer.client import Client
    from producer.jobs import build_job
    from producer.protocol import encode_job
    from producer.records import encode_dead_letter

    with Client(redis_url) as client:
        job = build_job("try again", {"max_tokens": 3}, job_id="dead-1")
        client.redis.hset(client.keys.job("dead-1"), mapping={"status": "failed", "error": "crash loop"})
        failed = client.redis.xadd(client.keys.dead, encode_dead_letter("1-1", encode_job(job), "delivered 4 times", "dead-1"))
        junk = client.redis.xadd(client.keys.dead, encode_dead_letter("1-2", {"foo": "bar"}, "cannot decode the entry"))
    listing = genq("dead", "ls", env_url=redis_url)
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert lines[0].startswith(f"{failed.decode()}\tdead-1\t") and lines[0].endswith("Z\tdelivered 4 times")
    assert lines[1].startswith(f"{junk.decode()}\t-\t")
    out = genq("dead", "--redis-url", redis_url, "retry", "--all")
    assert out.returncode == 0, out.stderr
    assert f"{failed.decode()}\tqueued as " in out.stdout and f"{junk.decode()}\tleft: the entry does not decode" in out.stdout
    taken = worker.take()
    assert (taken.id, taken.prompt, taken.sampling_params.max_tokens) == ("dead-1", "try again", 3)
    with Client(redis_url) as client:
        assert client.status("dead-1").value == "queued" and client.redis.xlen(client.keys.dead) == 1
    again = genq("dead", "retry", failed.decode(), env_url=redis_url)
    assert again.returncode == 1 and "no such dead letter" in again.stdout
    assert genq("dead", "retry", env_url=redis_url).returncode == 2


@pytest.mark.skipif(shutil.which("genq") is None, reason="package not installed (pip install -e .)")
def test_console_script_is_installed() -> None:
    out = subprocess.run(["genq", "--help"], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0 and "submit" in out.stdout
