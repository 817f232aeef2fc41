"""`genq worker` processes for the queue benchmarks: started on one Redis under one prefix,
ready once each heartbeat is there, stopped with SIGTERM (a drain) at the end; and `genq api`
beside them (`running_api`)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence

import httpx
import redis

from producer.protocol import Keys
from producer.redis_server import free_port

STARTUP_TIMEOUT_S = 300.0
API_START_TIMEOUT_S = 60.0


@contextlib.contextmanager
def running_workers(url: str, prefix: str, names: Sequence[str], args: Sequence[str],
                    env: Mapping[str, str] | None = None) -> Iterator[None]:
    """Workers `names`, each `genq worker --name NAME` plus `args` (in `env`: default this
    process's environment), for the `with` block."""
    logs, procs = [], []
    try:
        for name in names:
            log = tempfile.TemporaryFile()
            cmd = [sys.executable, "-m", "producer.cli", "worker", "--redis-url", url, "--prefix", prefix,
                   "--name", name, *args]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env))
            logs.append(log)
        conn = redis.Redis.from_url(url)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not all(conn.exists(Keys(prefix).worker(name)) for name in names):
            for proc, log in zip(procs, logs, strict=True):
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"a worker exited with {proc.returncode}:\n{log.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError("the workers did not start")
            time.sleep(0.2)  # polling a condition, bounded by the deadline
        conn.close()
        yield
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()


@contextlib.contextmanager
def running_api(redis_url: str, prefix: str, env: Mapping[str, str] | None = None) -> Iterator[str]:
    """`genq api` on a free port of 127.0.0.1 (its base URL), ready once /version answers;
    terminated at the end (its lifespan closes what it opened)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "producer.cli", "api", "--redis-url", redis_url, "--prefix", prefix,
                             "--log-level", "warning", "--port", str(port)], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + API_START_TIMEOUT_S
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("genq api did not start")
            try:
                httpx.get(url + "/version", timeout=1.0)
                break
            except httpx.HTTPError:
                time.sleep(0.2)  # polling a condition, bounded by the deadline
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
