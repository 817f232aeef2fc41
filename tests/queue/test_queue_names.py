"""Two workers started under one name at once: one takes the name and serves, the other waits
for it to expire instead of serving beside it."""

from __future__ import annotations

from collections.abc import Callable

import redis
from queue_support import READY_TIMEOUT_S, WorkerProcess, wait_for

from producer.protocol import decode_worker_info


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
