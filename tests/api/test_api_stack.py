"""`genq up` starts Redis, a worker and the API, serves a request, and stops everything on
Ctrl-C, Redis last; SIGHUP or a SIGKILL of `genq up` leaves no process behind either."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
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
def test_genq_up_serves_and_stops_on_ctrl_c(tiny_llama_dir: Path, tmp_path: Path) -> None:
    api_port, redis_port = free_port(), free_port()
    args = [sys.executable, "-m", "producer.cli", "up", "--port", str(api_port),
            "--redis-port", str(redis_port), "--redis-dir", str(tmp_path / "redis"),
            "--model", str(tiny_llama_dir),
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
        assert b"genq:requests" in (tmp_path / "redis" / "appendonly.aof").read_bytes()  # durable
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    with pytest.raises(ProcessLookupError):
        os.kill(worker_pid, 0)
    for port in (api_port, redis_port):
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/", timeout=2)


def gone(pid: int) -> bool:
    """No such process, or a zombie not reaped yet (it has stopped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; parent-death signal")
@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGKILL], ids=["SIGHUP", "SIGKILL"])
def test_genq_up_leaves_no_process_behind(signum: int, tiny_llama_dir: Path) -> None:
    """Signalled while its worker loads: SIGHUP runs genq up's cleanup (the path SIGTERM and
    Ctrl-C take too); SIGKILL runs none, and the kernel's parent-death signal stops the children."""
    args = [sys.executable, "-m", "producer.cli", "up", "--port", str(free_port()),
            "--redis-port", str(free_port()), "--ephemeral", "--model", str(tiny_llama_dir),
            "--dtype", "float32"]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=read_lines, args=(process.stdout, lines), daemon=True).start()
    pids: dict[str, int] = {}
    try:
        while "worker" not in pids:
            line = lines.get(timeout=READY_TIMEOUT_S)
            assert line is not None, "genq up exited before its worker started"
            found = re.match(r"genq: (redis|worker) .*?\(pid (\d+)", line)
            if found:
                pids[found.group(1)] = int(found.group(2))
        process.send_signal(signum)
        assert process.wait(60) == (0 if signum == signal.SIGHUP else -signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not all(gone(pid) for pid in pids.values()):
            assert time.monotonic() < deadline, f"still running: {pids}"
            time.sleep(0.05)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in pids.values():
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
