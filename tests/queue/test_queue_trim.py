"""A worker trims `genq:requests` and `genq:dead` on its heartbeat: entries of ended jobs leave the stream, and
an entry that some consumer group still holds pending stays, whoever acked it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
from queue_support import WorkerProcess, wait_for

from producer.client import Client
from producer.protocol import JobStatus, Keys
from producer.records import decode_worker_info
from producer.redis_server import RedisServer
from producer.sampling_params import SamplingParams

TIMEOUT_S = 30.0
SHORT = SamplingParams(temperature=0.0, max_tokens=2)


def wait_two_beats(conn: redis.Redis, keys: Keys, name: str) -> None:
    """Until the worker has written its heartbeat twice more: the trim that follows the first
    of those beats has then run."""
    def beat() -> float:
        return decode_worker_info(conn.hgetall(keys.worker(name)), name).heartbeat_at

    first = beat()
    second = wait_for(lambda: beat() > first and beat(), TIMEOUT_S, "a heartbeat")
    wait_for(lambda: beat() > second, TIMEOUT_S, "another heartbeat")


@pytest.fixture(scope="module")
def trimmer(spawn: Callable[..., WorkerProcess], conn: redis.Redis) -> WorkerProcess:
    """A worker keeping nothing of an ended job but its record: its entry, a dead letter and
    its events may go at once."""
    worker = spawn("trimmer", GENQ_REQUESTS_RETENTION_S="0", GENQ_DEAD_RETENTION_S="0",
                   GENQ_EVENTS_RETENTION_S="0")
    worker.wait_ready(conn)
    return worker


def test_an_ended_jobs_events_go_after_the_retention_its_record_stays(
    trimmer: WorkerProcess, conn: redis.Redis, redis_server: RedisServer
) -> None:
    keys = trimmer.keys
    with Client(redis_server.url, prefix=keys.prefix) as client:
        handle = client.submit("events retention", SHORT)
        result = handle.result(TIMEOUT_S)
        assert conn.exists(keys.job(handle.id)) and result.token_ids
        assert not conn.exists(keys.events(handle.id))  # GENQ_EVENTS_RETENTION_S=0: deleted as it ended
        assert [d.token_ids for d in handle.stream(TIMEOUT_S)] == [result.token_ids]  # from the record


def test_worker_trims_ended_jobs_entries_but_not_pending_ones(
    trimmer: WorkerProcess, conn: redis.Redis, redis_server: RedisServer
) -> None:
    worker = trimmer
    keys = worker.keys

    def entries() -> list[bytes]:
        return [entry_id for entry_id, _ in conn.xrange(keys.requests)]

    with Client(redis_server.url, prefix=keys.prefix) as client:
        ended = [client.submit(f"short {i}", SHORT) for i in range(3)]
        assert all(h.result(TIMEOUT_S).status == JobStatus.FINISHED for h in ended)
        # a second group (an auditor, say) that reads the next entry and has not acked it yet
        conn.xgroup_create(keys.requests, "audit", id="$")
        held = client.submit("held by the audit group", SHORT)
        [[_, [(held_entry, _)]]] = conn.xreadgroup("audit", "auditor", {keys.requests: ">"}, count=1)
        assert held.result(TIMEOUT_S).status == JobStatus.FINISHED  # acked in the workers' group
        wait_for(lambda: entries() == [held_entry], TIMEOUT_S, "the ended jobs' entries trimmed")
        wait_two_beats(conn, keys, worker.name)
        assert entries() == [held_entry]
        conn.xack(keys.requests, "audit", held_entry)
        wait_for(lambda: conn.xlen(keys.requests) == 0, TIMEOUT_S, "the released entry trimmed")
        # an entry no worker can read goes to the dead stream, and from there on the next beat
        conn.xadd(keys.requests, {"id": "bad-payload", "payload": b"\xc1"})
        wait_for(lambda: conn.hget(keys.job("bad-payload"), "status") == b"failed", TIMEOUT_S,
                 "the job failed")
        assert conn.xinfo_stream(keys.dead)["last-generated-id"] != b"0-0"  # a letter was written
        wait_for(lambda: conn.xlen(keys.dead) == 0, TIMEOUT_S, "the dead letter trimmed")
