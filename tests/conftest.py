"""Fixtures shared by every test package: one real Redis server on loopback per session.

`redis_url` hands each test an empty database; tests never touch a server they did not start.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis
import torch

from producer.redis_server import RedisServer

# Triton reads this when kernels are defined: set it before anything imports `kernels`, so the
# kernel tests run in the interpreter on machines without a GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """URL of the session's server, flushed before each test so tests cannot see each other."""
    conn = redis.Redis.from_url(redis_server.url)
    conn.flushall()
    conn.close()
    yield redis_server.url


@pytest.fixture
def redis_conn(redis_url: str) -> Iterator[redis.Redis]:
    """A plain redis-py connection (bytes replies) to the test database."""
    conn = redis.Redis.from_url(redis_url)
    yield conn
    conn.close()
