"""A live stack for the API tests: a Redis server and a real worker subprocess on the tiny
Llama, shared by the module, and uvicorn serving an app on a free port in a thread.

The Redis server is the module's own (not the session's `redis_url`, which is flushed before
every test and would wipe the worker's consumer group and heartbeat under it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from api.main import create_app
from api.settings import Settings
from producer.protocol import Keys
from producer.redis_conn import connect
from producer.redis_server import RedisServer, free_port

WORKER_NAME = "api-test"
SERVED_MODEL = "tiny-llama"
WORKER_READY_TIMEOUT_S = 120.0  # model load (torch import) on a slow CI machine
POLL_TIMEOUT_S = 20.0
# the live worker's thinking markers: the tiny model's chat template ends its prompts with the start
THINKING = {"think_start_str": "<|im_start|>assistant\n", "think_end_str": "</think>"}


def wait_for(
    condition: Callable[[], Any], timeout_s: float = POLL_TIMEOUT_S, what: str = ""
) -> Any:
    """Poll `condition` until it returns something truthy; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"{what or 'condition'} not met within {timeout_s} s")


@contextmanager
def serve(settings: Settings) -> Iterator[str]:
    """Run `create_app(settings)` with uvicorn in a thread; yields its base URL."""
    config = uvicorn.Config(
        create_app(settings), host="127.0.0.1", port=free_port(), log_level="warning",
        lifespan="on",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), what="uvicorn start")
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def file_server(files: dict[str, tuple[bytes, str]]) -> Iterator[str]:
    """An HTTP server on loopback answering GET `path` with files[path] (body, content type),
    anything else with 404; yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body, kind = files.get(self.path, (b"", "text/plain"))
            self.send_response(200 if self.path in files else 404)
            self.send_header("Content-Type", kind)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="session")
def serve_files() -> Callable[[dict[str, tuple[bytes, str]]], Any]:
    return file_server


@pytest.fixture(scope="session")
def serve_api() -> Callable[[Settings], Any]:
    """`with serve_api(settings) as url:` runs an app on a free port (see `serve`)."""
    return serve


@pytest.fixture(scope="session")
def poll() -> Callable[..., Any]:
    """`poll(condition, timeout_s, what)`: see `wait_for`."""
    return wait_for


@pytest.fixture(scope="module")
def stack_redis() -> Iterator[RedisServer]:
    """A module's own Redis, for a module's own workers."""
    with RedisServer() as server:
        yield server


def start_worker(redis_url: str, model_dir: Path, log_path: Path, extra_args: tuple[str, ...] = (),
                 name: str = WORKER_NAME) -> subprocess.Popen[bytes]:
    """`genq worker` on the tiny model, small enough for a CPU (its KV cache 512 blocks, unless
    `extra_args` give its memory)."""
    blocks = () if "--kv-cache-memory-gb" in extra_args else ("--num-gpu-blocks-override", "512")
    args = [
        sys.executable, "-m", "producer.cli", "worker", "--redis-url", redis_url,
        "--model", str(model_dir), "--dtype", "float32", "--name", name,
        "--served-model-name", SERVED_MODEL, "--max-num-seqs", "8", "--max-model-len", "1024",
        *blocks, "--heartbeat-s", "0.5", "--num-threads", "1", *extra_args,
    ]
    env = dict(os.environ)
    with open(log_path, "wb") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)


@contextmanager
def running_worker(redis_url: str, model_dir: Path, log_dir: Path, extra_args: tuple[str, ...] = (),
                   name: str = WORKER_NAME) -> Iterator[str]:
    """A real worker named `name` serving SERVED_MODEL (with `extra_args` on its command
    line) until the block ends; yields the Redis URL once its heartbeat is there."""
    log_path = log_dir / f"{name}.log"
    process = start_worker(redis_url, model_dir, log_path, extra_args, name)
    conn = connect(redis_url)  # (a Redis Cluster's URL too)
    beat = Keys().worker(name)
    try:
        wait_for(
            lambda: conn.exists(beat) or process.poll() is not None,
            WORKER_READY_TIMEOUT_S, "worker heartbeat",
        )
        assert process.poll() is None, f"worker exited:\n{log_path.read_text()[-3000:]}"
        yield redis_url
    finally:
        conn.close()
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@pytest.fixture(scope="session")
def run_worker() -> Callable[..., Any]:
    """`with run_worker(redis_url, model_dir, log_dir, extra_args) as url:` a worker with more
    flags (see `running_worker`), for modules that override `live_worker`."""
    return running_worker


@pytest.fixture(scope="session")
def shared_redis() -> Iterator[RedisServer]:
    """The Redis behind the shared worker (`live_worker`)."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def live_worker(shared_redis: RedisServer, tiny_llama_dir: Path, tmp_path_factory) -> Iterator[str]:
    """A real worker serving SERVED_MODEL; yields the Redis URL. Waits for its heartbeat.
    One for the session: the modules that use it leave it serving. A module that needs
    another worker overrides this fixture with its own, on its own Redis (`stack_redis`). It
    loads genq's NoRepeatNGram logits processor (requests without its setting are untouched),
    and reads a reply's thinking as opened by the chat template's generation prompt, as
    DeepSeek-R1's template opens it (THINKING: requests without a thinking_token_budget are
    untouched)."""
    with running_worker(shared_redis.url, tiny_llama_dir, tmp_path_factory.mktemp("worker"),
                        ("--logits-processors", "worker.sample.logits_processors:NoRepeatNGram",
                         "--reasoning-config", json.dumps(THINKING))) as url:
        yield url


@pytest.fixture(scope="session")
def live_thinking() -> dict[str, str]:
    """The live worker's reasoning_config: where its replies' thinking starts and ends."""
    return THINKING


@pytest.fixture(scope="session")
def served_model() -> str:
    """The model name the live worker serves (its --served-model-name)."""
    return SERVED_MODEL


@pytest.fixture(scope="module")
def api_url(live_worker: str) -> Iterator[str]:
    """The API in front of the live worker, no API keys, default limits."""
    with serve(Settings(redis_url=live_worker, request_timeout_s=60.0)) as url:
        yield url


@pytest.fixture(scope="module")
def oai(api_url: str) -> Iterator[openai.OpenAI]:
    """The official OpenAI client on the module's API."""
    client = openai.OpenAI(base_url=f"{api_url}/v1", api_key="unused", max_retries=0, timeout=60)
    yield client
    client.close()


@pytest.fixture
def http(api_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api_url, timeout=60.0) as client:
        yield client
