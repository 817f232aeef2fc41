"""The `queue` mode of `genq bench throughput`: the whole path, client -> Redis stream ->
worker -> events -> client, timed from the first submit to the last final event.

Without `--redis-url` (or GENQ_REDIS_URL) the command starts its own Redis on a free loopback
port; it always starts one worker subprocess (`genq worker`) with the same engine arguments as
the engine mode, and stops both when done."""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import redis

from producer.client import Client
from producer.protocol import Keys
from producer.redis_server import RedisServer
from worker.benchmarks.workload import Workload, summarize

WORKER_NAME = "genq-bench"
STARTUP_TIMEOUT_S = 300.0


def run_queue(args: argparse.Namespace, workload: Workload, engine_args: dict[str, Any]) -> dict[str, Any]:
    with _redis(args) as url, _worker(url, args, engine_args):
        client = Client(url)
        prompts, params = workload.prompts(), workload.sampling_params()
        client.generate(prompts[:2], params[:2], use_tqdm=False, timeout_s=STARTUP_TIMEOUT_S)  # warm-up
        start = time.perf_counter()
        results = client.generate(prompts, params, use_tqdm=False, timeout_s=3600)
        elapsed = time.perf_counter() - start
        failed = [r for r in results if r.error]
        if failed:
            raise RuntimeError(f"{len(failed)} queue jobs failed, first: {failed[0].error}")
        num_out = sum(len(o.token_ids) for r in results for o in r.outputs)
        num_in = sum(r.usage.get("prompt_tokens", 0) for r in results if r.usage)
        client.close()
    return summarize(elapsed, len(results), num_in, num_out)


@contextlib.contextmanager
def _redis(args: argparse.Namespace) -> Iterator[str]:
    if args.redis_url:
        yield args.redis_url
        return
    with RedisServer() as server:
        yield server.url


@contextlib.contextmanager
def _worker(url: str, args: argparse.Namespace, engine_args: dict[str, Any]) -> Iterator[None]:
    cmd = [sys.executable, "-m", "producer.cli", "worker", "--redis-url", url, "--name", WORKER_NAME,
           "--dtype", args.dtype]
    if args.model:
        cmd += ["--model", args.model]
    for key, value in engine_args.items():
        if value is not None:
            cmd += ["--" + key.replace("_", "-"), str(value)]
    # stderr to a file, not a pipe: nobody reads it while the worker runs, and a full pipe
    # would block the worker mid-benchmark.
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    try:
        _wait_for_heartbeat(url, proc, log)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait_for_heartbeat(url: str, proc: subprocess.Popen, log) -> None:
    conn = redis.Redis.from_url(url)
    key = Keys().worker(WORKER_NAME)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not conn.exists(key):
        if proc.poll() is not None:
            log.seek(0)
            err = log.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"the benchmark worker exited with {proc.returncode}:\n{err}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no heartbeat from the benchmark worker within {STARTUP_TIMEOUT_S:.0f} s")
        time.sleep(0.2)  # polling a condition, bounded by the deadline
    conn.close()
