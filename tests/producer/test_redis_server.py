"""`genq redis` as a user runs it: a real redis-server subprocess that keeps its data across a
kill and a restart (append-only file) unless `--ephemeral`, and leaves no server behind whichever
way the command is stopped, SIGKILL included."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from producer.redis_server import RedisServer, RedisServerError, default_data_dir, free_port

GENQ = [sys.executable, "-m", "producer.cli"]
TIMEOUT_S = 30.0
POLL_S = 0.02
STREAM, HASH = b"genq:requests", b"genq:job:kept-1"


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout_s} s")
        time.sleep(POLL_S)
    return value


def gone(pid: int) -> bool:
    """The process is no more: no such pid, or a zombie nobody reaped yet (it has stopped; a
    container's init may be slow to reap an orphan)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


class GenqRedis:
    """`genq redis ARGS` as a subprocess, once its server answers: `pid` is the redis-server's."""

    def __init__(self, port: int, args: list[str], env: dict[str, str]) -> None:
        self.port = port
        self.proc = subprocess.Popen([*GENQ, "redis", "--port", str(port), *args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        self.line = self.proc.stdout.readline()  # printed once PING answers
        found = re.search(r"\(pid (\d+)\)", self.line)
        self.pid = int(found.group(1)) if found and f"127.0.0.1:{port}/0" in self.line else None

    def conn(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(TIMEOUT_S)
        if self.pid is not None and not gone(self.pid):
            os.kill(self.pid, signal.SIGKILL)  # only if the code under test left it running


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """No GENQ_REDIS_URL, and the per-user data dir inside the test's tmp dir, never $HOME."""
    environ = {k: v for k, v in os.environ.items() if k != "GENQ_REDIS_URL"}
    return {**environ, "XDG_DATA_HOME": str(tmp_path / "data-home")}


@pytest.fixture
def start(env: dict[str, str]) -> Iterator[Callable[..., GenqRedis]]:
    """`start(*args, port=None)`: a running `genq redis`; a free port (tried again if someone took
    it meanwhile) unless given. Every one started is stopped at the end."""
    started: list[GenqRedis] = []

    def start_one(*args: str, port: int | None = None) -> GenqRedis:
        for _ in range(1 if port is not None else 3):
            started.append(GenqRedis(port or free_port(), list(args), env))
            if started[-1].pid is not None:
                return started[-1]
            started[-1].proc.wait(TIMEOUT_S)
        raise AssertionError(f"genq redis did not start: {started[-1].line!r}")

    yield start_one
    for one in started:
        one.close()


def aof_holds(data_dir: Path, data: bytes) -> bool:
    """Some append-only file under the dir (Redis 6.2: appendonly.aof; 7: appendonlydir/) has
    the bytes: written to the file, so a SIGKILL of the server cannot lose them."""
    return any(data in path.read_bytes() for path in data_dir.rglob("appendonly*") if path.is_file())


@pytest.mark.parametrize("mode", ["dir", "default-dir", "ephemeral"])
def test_data_survives_a_killed_server_unless_ephemeral(
    mode: str, start: Callable[..., GenqRedis], tmp_path: Path, env: dict[str, str]
) -> None:
    args = {"dir": ["--dir", str(tmp_path / "d")], "default-dir": [], "ephemeral": ["--ephemeral"]}[mode]
    first = start(*args)
    data_dir = tmp_path / "d" if mode == "dir" else default_data_dir(first.port, env["XDG_DATA_HOME"])
    assert (str(data_dir) in first.line) == (mode != "ephemeral"), first.line
    with first.conn() as conn:
        entry_id = conn.xadd(STREAM, {b"job": b"queued"})
        conn.hset(HASH, mapping={b"status": b"running", b"tokens": b"3"})
    if mode != "ephemeral":
        wait_for(lambda: aof_holds(data_dir, HASH), "the hash in the append-only file")
    os.kill(first.pid, signal.SIGKILL)
    assert first.proc.wait(TIMEOUT_S) == 1  # genq redis reports its server's death
    again = start(*args, port=first.port)  # the same command again
    with again.conn() as conn:
        if mode == "ephemeral":
            assert conn.dbsize() == 0
            assert not list(tmp_path.rglob("appendonly*"))
        else:
            assert conn.xrange(STREAM) == [(entry_id, {b"job": b"queued"})]
            assert conn.hgetall(HASH) == {b"status": b"running", b"tokens": b"3"}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT],
                         ids=["SIGTERM", "SIGHUP", "SIGINT"])
def test_stop_signal_stops_the_server(signum: int, start: Callable[..., GenqRedis]) -> None:
    one = start("--ephemeral")
    assert one.conn().ping()
    one.proc.send_signal(signum)
    assert one.proc.wait(TIMEOUT_S) == 0
    assert gone(one.pid)  # genq redis waited for it
    with pytest.raises(redis.ConnectionError):
        one.conn().ping()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux's")
def test_killed_genq_redis_takes_its_server_along(start: Callable[..., GenqRedis], tmp_path: Path) -> None:
    one = start("--dir", str(tmp_path / "d"))
    one.proc.kill()  # no cleanup runs: the kernel tells the server
    one.proc.wait(TIMEOUT_S)
    wait_for(lambda: gone(one.pid), "redis-server stopped", timeout_s=10)


def test_durable_server_needs_a_dir() -> None:
    with pytest.raises(RedisServerError, match="needs a dir"):
        RedisServer(durable=True)
