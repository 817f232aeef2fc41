"""Fixtures for the queue tests: a Redis connection under a module prefix, the offline
engine as the oracle, and worker subprocesses (see queue_support)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from queue_support import LIVE_WORKERS, WorkerProcess, worker_env

from producer.client import Client
from producer.protocol import Keys
from producer.redis_server import RedisServer
from producer.sampling_params import SamplingParams

LOG_TAIL_CHARS = 6000


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when == "call" and report.failed:
        for worker in LIVE_WORKERS:
            report.sections.append((f"worker {worker.name} log (tail)", worker.log()[-LOG_TAIL_CHARS:]))


@pytest.fixture(scope="module")
def conn(redis_server: RedisServer) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_server.url)
    yield c
    c.close()


@pytest.fixture
def keys(worker: WorkerProcess) -> Keys:
    """The Redis names of the module's `worker` fixture (modules with several workers
    override this with one of theirs: they all share the module's prefix)."""
    return worker.keys


@pytest.fixture
def client(redis_server: RedisServer, keys: Keys) -> Iterator[Client]:
    """A client under the module's prefix."""
    with Client(redis_server.url, prefix=keys.prefix) as c:
        yield c


class Offline:
    """`offline(prompt, params)`: the completions the in-process LLM produces for a prompt in
    any form the client takes (greedy params give the tokens any worker must produce);
    `offline(..., whole=True)`: its whole RequestOutput. `offline.many(prompts, params)`:
    each text prompt's completions, from one batch (greedy tokens do not depend on it)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def __call__(self, prompt: object, params: SamplingParams, whole: bool = False) -> Any:
        with _one_thread():
            generate = self.llm.chat if isinstance(prompt, list) else self.llm.generate
            out = generate(prompt, params, use_tqdm=False)[0]
        return out if whole else out.outputs

    def many(self, prompts: list[str], params: SamplingParams) -> list[Any]:
        with _one_thread():
            return [out.outputs for out in self.llm.generate(prompts, params, use_tqdm=False)]


@contextmanager
def _one_thread() -> Iterator[None]:
    """One torch thread: the tiny model is far faster so beside worker processes on few cores.
    Restored after, so other test packages keep their setting."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def offline(tiny_llama_dir: Path) -> Offline:
    from worker import LLM

    return Offline(LLM(model=str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=512, max_num_seqs=16))


@pytest.fixture(scope="module")
def spawn(
    redis_server: RedisServer, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Callable[..., WorkerProcess]]:
    """`spawn(name, via="arq", args=(), **env)` starts a worker under this module's prefix;
    every worker spawned is stopped at the end of the module."""
    prefix = f"t-{request.module.__name__.rsplit('.', 1)[-1]}:"
    logs = tmp_path_factory.mktemp("worker-logs")
    workers: list[WorkerProcess] = []

    def start(name: str, via: str = "arq", args: tuple[str, ...] = (), **env: str) -> WorkerProcess:
        worker = WorkerProcess(
            worker_env(redis_server.url, tiny_llama_dir, name, prefix, **env),
            logs / f"{name}.log", via, args,
        )
        workers.append(worker.start())
        LIVE_WORKERS.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.stop()
        LIVE_WORKERS.remove(worker)
