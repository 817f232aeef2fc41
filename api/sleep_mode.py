"""Sleep mode, cluster-wide (vLLM's POST /sleep, POST /wake_up and GET /is_sleeping, behind
GENQ_SERVER_DEV_MODE): every worker of a model stops taking jobs, lets its running ones end,
and gives its device's memory back to a trainer that shares it; woken, it takes jobs again.

The command is the hash `genq:sleep:<model>` (producer.records.SleepCommand): a count, a level
(0: wake) and the tags to wake. Each worker of the model follows it at its heartbeat, and one
that starts later reads it with its model. Jobs sent meanwhile wait in the queue (or run on a
model's workers that are awake): nothing is lost. A call returns once every serving worker of
the model says, in its heartbeat, that it acted on the command.
"""

from __future__ import annotations

import time

from api.cluster import Cluster
from api.errors import APIError
from api.lora_adapters import confirm
from api.weights_updates import model_of, write_command
from producer.async_client import AsyncClient
from producer.records import SLEEP_TAGS, WorkerInfo

CONFIRM_SLEEP_S = 300.0  # a sleep waits for the running jobs to end


async def command(client: AsyncClient, cluster: Cluster, model: str | None, level: int,
                  tags: tuple[str, ...] = SLEEP_TAGS) -> str:
    """Write the sleep (`level` 1 or 2) or wake (0, the parts `tags` names) command for the
    model's workers and wait until each serving one acted on it; the model's name."""
    name = await model_of(cluster, model)
    key = client.keys.sleep(name)
    count = await write_command(client, cluster, key, {"level": level, "tags": ",".join(tags)})
    what = f"sleep (level {level})" if level else f"wake {' and '.join(tags)}"
    failed: set[str] = set()
    whole_wake = not level and set(tags) == set(SLEEP_TAGS)

    def done(worker: str, info: WorkerInfo) -> bool:
        # (one that could not, waking weights from a checkpoint gone since, say, is as it was)
        if info.sleep_command == count and ((level and not info.sleep_level) or (whole_wake and info.sleep_level)):
            failed.add(worker)
        return info.sleep_command >= count

    await confirm(cluster, time.time(), done, what, applies=lambda info: info.model == name,
                  timeout_s=CONFIRM_SLEEP_S)
    if failed:
        raise APIError(500, f"Workers {', '.join(sorted(failed))} could not {what} (their logs say why).",
                       type="server_error", code="sleep_failed")
    return name


async def is_sleeping(cluster: Cluster, model: str | None) -> bool:
    """Whether every serving worker of the model sleeps (and one does)."""
    name = await model_of(cluster, model)
    levels = [w.info.sleep_level for w in await cluster.workers() if w.serving and w.info.model == name]
    return bool(levels) and all(levels)
