"""`genq up`: the whole stack on localhost for `make run`: the embedded Redis, one worker and
the API, each started as its own process and waited for (polled, no fixed sleeps). Prints the
URL and a curl line to try; Ctrl-C, SIGTERM or SIGHUP stops everything, API first, Redis
last. Redis keeps an append-only file in its data dir (`--redis-dir`; `--ephemeral` for memory
only), so `genq up` run again brings back every queued and running job. On Linux every child
also gets SIGTERM from the kernel when `genq up` dies without cleanup (SIGKILL).

This module only starts processes: it imports neither torch nor the API.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import redis

from producer.children import die_with_parent, stop_signals_ignored, stop_signals_interrupt
from producer.protocol import Keys
from producer.redis_server import RedisServerError, command_server

WORKER_READY_TIMEOUT_S = 900.0  # the first run converts the default model
API_READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0  # per process: SIGTERM, then SIGKILL (the worker drains in-flight jobs)
POLL_S = 0.2
WORKER_NAME = "genq-up"


class StackError(RuntimeError):
    """A process exited or did not get ready in time."""


def build(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    parser.add_argument("--host", default="127.0.0.1", help="API address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="API port (default: %(default)s)")
    parser.add_argument("--redis-port", type=int, default=6379, help="embedded Redis port")
    parser.add_argument("--redis-dir", help="embedded Redis's data directory: its append-only file "
                        "survives restarts (default: $XDG_DATA_HOME/genq/redis-PORT, "
                        "else ~/.local/share/genq/redis-PORT)")
    parser.add_argument("--ephemeral", action="store_true",
                        help="embedded Redis in memory only: a restart forgets every job")
    parser.add_argument("--model", help="model directory (default: the worker's default model)")
    parser.add_argument("--dtype", help="worker dtype (default: the worker's)")
    parser.add_argument("--served-model-name", help="the name clients use (default: the worker's)")
    return run


def run(args: argparse.Namespace) -> int:
    """Start, wait for Ctrl-C / SIGTERM / SIGHUP or a process to die, stop everything."""
    stack = Stack(args, os.environ.get("XDG_DATA_HOME"))
    with stop_signals_interrupt():
        try:
            stack.start()
            print(stack.banner(), flush=True)
            stack.supervise()
        except KeyboardInterrupt:
            print("\ngenq: stopping", file=sys.stderr, flush=True)
            return 0
        except (StackError, RedisServerError, redis.RedisError) as exc:
            print(f"genq: {exc}", file=sys.stderr, flush=True)
            return 1
        finally:
            with stop_signals_ignored():  # a second signal must not cut the cleanup short
                stack.stop()
    return 1


class Stack:
    """The three processes, started in order and stopped in reverse."""

    def __init__(self, args: argparse.Namespace, data_home: str | None) -> None:
        self.args = args
        # out of the terminal's process group, as the others: stopped last, by us
        self.redis = command_server(args.redis_port, args.redis_dir, args.ephemeral, data_home,
                                    own_session=True)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}  # name -> process, start order
        self.model = ""

    @property
    def api_url(self) -> str:
        host = "127.0.0.1" if self.args.host in ("0.0.0.0", "::") else self.args.host
        return f"http://{host}:{self.args.port}"

    def start(self) -> None:
        self.redis.start()
        print(f"genq: redis on {self.redis.url} (pid {self.redis.pid}), {self.redis.data_note()}",
              file=sys.stderr, flush=True)
        self.processes["worker"] = _spawn(self._worker_args())
        print(f"genq: worker starting (pid {self.processes['worker'].pid}, loading the model)...",
              file=sys.stderr, flush=True)
        self.model = self._wait_worker()
        self.processes["api"] = _spawn(self._api_args())
        self._wait_api()

    def _genq(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "producer.cli", *args, "--redis-url", self.redis.url]

    def _worker_args(self) -> list[str]:
        args = self._genq("worker", "--name", WORKER_NAME)
        for flag in ("model", "dtype", "served_model_name"):
            value = getattr(self.args, flag)
            if value is not None:
                args += [f"--{flag.replace('_', '-')}", str(value)]
        return args

    def _api_args(self) -> list[str]:
        return self._genq("api", "--host", self.args.host, "--port", str(self.args.port))

    def _wait_worker(self) -> str:
        """Until the worker's heartbeat hash appears; returns the model name it serves."""
        conn = redis.Redis.from_url(self.redis.url)
        key = Keys().worker(WORKER_NAME)
        try:
            model = self._poll("worker", WORKER_READY_TIMEOUT_S, lambda: conn.hget(key, "model"))
        finally:
            conn.close()
        return model.decode()

    def _wait_api(self) -> None:
        self._poll("api", API_READY_TIMEOUT_S, lambda: _http_ok(f"{self.api_url}/health"))

    def _poll(self, name: str, timeout_s: float, ready: Callable[[], Any]) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            value = ready()
            if value:
                return value
            time.sleep(POLL_S)
        raise StackError(f"{name} not ready within {timeout_s:.0f} s")

    def _check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise StackError(f"{name} exited with status {process.returncode}")

    def supervise(self) -> None:
        """Block until Ctrl-C (KeyboardInterrupt) or a process dies (StackError)."""
        while True:
            self._check_alive()
            if self.redis.process is None or self.redis.process.poll() is not None:
                raise StackError("redis-server exited")
            time.sleep(POLL_S)

    def stop(self) -> None:
        for name in reversed(list(self.processes)):
            _terminate(self.processes.pop(name), name)
        self.redis.stop()

    def banner(self) -> str:
        body = {"model": self.model, "messages": [{"role": "user", "content": "Hello!"}],
                "max_tokens": 32}
        auth = ""
        if os.environ.get("GENQ_API_KEYS"):
            auth = ' -H "Authorization: Bearer $KEY"'
        curl = (f"curl {self.api_url}/v1/chat/completions -H 'Content-Type: application/json'"
                f"{auth} -d {shlex.quote(json.dumps(body))}")
        return "\n".join([
            f"genq is up: {self.api_url}  (docs: /docs, metrics: /metrics)",
            f"  redis {self.redis.url}, worker {WORKER_NAME!r} serving {self.model!r}",
            "try:",
            f"  {curl}",
            "Ctrl-C stops everything.",
        ])


def _spawn(args: list[str]) -> subprocess.Popen[bytes]:
    """Its own session: a terminal's Ctrl-C reaches only `genq up`, which then stops the
    processes in order instead of all at once. Should `genq up` be killed before it can, the
    kernel sends the process SIGTERM (Linux), which it takes as a clean stop."""
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=die_with_parent())


def _terminate(process: subprocess.Popen[bytes], name: str) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"genq: {name} did not stop in {STOP_TIMEOUT_S:.0f} s; killing it", file=sys.stderr)
        process.kill()
        process.wait(STOP_TIMEOUT_S)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False
