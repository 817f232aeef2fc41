"""`genq up` starts Redis, a worker and the API, serves a request, and stops everything on
Ctrl-C, Redis last."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import redis

from producer.redis_server import free_port
from producer.stack import WORKER_NAME

READY_TIMEOUT_S = 120.0


def read_lines(stream, lines: queue.Queue) -> None:
    for line in iter(stream.readline, b""):
        lines.put(line.decode(errors="replace"))
    lines.put(None)


def wait_for_banner(lines: queue.Queue) -> list[str]:
    seen = []
    while True:
        line = lines.get(timeout=READY_TIMEOUT_S)
        if line is None:
            raise AssertionError("genq up exited:\n" + "".join(seen[-40:]))
        seen.append(line)
        if line.startswith("Ctrl-C stops everything"):
            return seen


@pytest.mark.timeout(300)
def test_genq_up_serves_and_stops_on_ctrl_c(tiny_llama_dir: Path) -> None:
    api_port, redis_port = free_port(), free_port()
    args = [sys.executable, "-m", "producer.cli", "up", "--port", str(api_port),
            "--redis-port", str(redis_port), "--model", str(tiny_llama_dir),
            "--dtype", "float32", "--served-model-name", "tiny"]
    # its own process group, to which Ctrl-C in a terminal goes: every process in it gets SIGINT;
    # a small KV pool (the worker reads the environment), not the 2 GB a CPU worker fills by default
    env = {**os.environ, "GENQ_NUM_GPU_BLOCKS": "64"}
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=read_lines, args=(process.stdout, lines), daemon=True).start()
    try:
        banner = "".join(wait_for_banner(lines))
        url = f"http://127.0.0.1:{api_port}"
        assert f"genq is up: {url}" in banner and f"curl {url}/v1/chat/completions" in banner
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        conn = redis.Redis(port=redis_port)
        worker_pid = int(conn.hget(f"genq:workers:{WORKER_NAME}", "pid"))
        conn.close()
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(60) == 0
        output = "".join(iter(lines.get, None))
        assert "Traceback" not in output, output  # Redis outlived the worker's clean shutdown
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    with pytest.raises(ProcessLookupError):
        os.kill(worker_pid, 0)
    for port in (api_port, redis_port):
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
