"""One name, one worker: two workers started under one name at once do not both serve, and a
worker that stalled past its heartbeat TTL while a namesake took the name stops."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import redis
from queue_support import READY_TIMEOUT_S, WorkerProcess, wait_for

from producer.records import decode_worker_info


def test_namesakes_starting_together_serve_one_at_a_time(
    spawn: Callable[..., WorkerProcess], conn: redis.Redis
) -> None:
    twins = spawn("twin-a", GENQ_WORKER_NAME="twin"), spawn("twin-b", GENQ_WORKER_NAME="twin")  # own logs

    def waiting() -> WorkerProcess | None:
        return next((w for w in twins if "is in use by pid" in w.log()), None)

    loser = wait_for(waiting, READY_TIMEOUT_S, "one namesake waiting for the name")
    winner = twins[1] if loser is twins[0] else twins[0]
    info = decode_worker_info(conn.hgetall(loser.keys.worker("twin")), "twin")
    assert info.pid == winner.pid
    assert f"in use by pid {winner.pid}" in loser.log()
    wait_for(lambda: " serving " in winner.log(), READY_TIMEOUT_S, "the winner serving")
    assert " serving " not in loser.log()


def test_a_stalled_worker_whose_name_was_taken_stops(
    spawn: Callable[..., WorkerProcess], conn: redis.Redis
) -> None:
    stalled = spawn("sleepy-a", GENQ_WORKER_NAME="sleepy")
    stalled.wait_ready(conn)
    key = stalled.keys.worker("sleepy")
    os.kill(stalled.pid, signal.SIGSTOP)  # a long pause: no heartbeats
    conn.delete(key)  # what its TTL would do after 30 s
    successor = spawn("sleepy-b", GENQ_WORKER_NAME="sleepy")
    wait_for(lambda: conn.hget(key, "pid") == str(successor.pid).encode(), READY_TIMEOUT_S, "the successor's heartbeat")
    os.kill(stalled.pid, signal.SIGCONT)
    assert stalled.wait(READY_TIMEOUT_S) == 0  # drained and exited
    assert f"was taken by host {os.uname().nodename}, pid {successor.pid}" in stalled.log()
    assert decode_worker_info(conn.hgetall(key), "sleepy").pid == successor.pid  # left in place
    assert successor.process is not None and successor.process.poll() is None
