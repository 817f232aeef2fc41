"""One name, one worker: of two workers started under one name at once, one serves and the
other waits for the name; when the one serving stalls past its heartbeat TTL, the other takes
the name, and the stalled one, once it runs again, stops."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import redis
from queue_support import READY_TIMEOUT_S, WorkerProcess, wait_for

from producer.records import decode_worker_info


def test_namesakes_serve_one_at_a_time_and_a_stalled_one_whose_name_was_taken_stops(
    spawn: Callable[..., WorkerProcess], conn: redis.Redis
) -> None:
    twins = spawn("twin-a", GENQ_WORKER_NAME="twin"), spawn("twin-b", GENQ_WORKER_NAME="twin")  # own logs

    def waiting() -> WorkerProcess | None:
        return next((w for w in twins if "is in use by pid" in w.log()), None)

    waiter = wait_for(waiting, READY_TIMEOUT_S, "one namesake waiting for the name")
    holder = twins[1] if waiter is twins[0] else twins[0]
    key = holder.keys.worker("twin")
    assert decode_worker_info(conn.hgetall(key), "twin").pid == holder.pid
    assert f"in use by pid {holder.pid}" in waiter.log()
    wait_for(lambda: " serving " in holder.log(), READY_TIMEOUT_S, "the holder serving")
    assert " serving " not in waiter.log()
    # the holder stalls (no heartbeats) and its heartbeat expires: the waiter takes the name
    os.kill(holder.pid, signal.SIGSTOP)
    conn.delete(key)  # what its TTL would do after 30 s
    wait_for(lambda: conn.hget(key, "pid") == str(waiter.pid).encode(), READY_TIMEOUT_S, "the waiter's heartbeat")
    wait_for(lambda: " serving " in waiter.log(), READY_TIMEOUT_S, "the waiter serving")
    os.kill(holder.pid, signal.SIGCONT)
    assert holder.wait(READY_TIMEOUT_S) == 0  # drained and exited
    assert f"was taken by host {os.uname().nodename}, pid {waiter.pid}" in holder.log()
    assert decode_worker_info(conn.hgetall(key), "twin").pid == waiter.pid  # left in place
    assert waiter.process is not None and waiter.process.poll() is None
