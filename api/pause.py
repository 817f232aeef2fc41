"""Pausing generation, cluster-wide (vLLM's POST /pause, POST /resume and GET /is_paused,
behind GENQ_SERVER_DEV_MODE): every worker of a model stops taking jobs, so a trainer can
update the weights between two batches of rollouts; resumed, it takes jobs again.

The command is the hash `genq:pause:<model>` (producer.records.PauseCommand): a count, whether
to be paused, and what becomes of the running requests (`mode`): "abort" ends them now
(finish_reason `abort`, the tokens they wrote kept), "wait" lets them end, "keep" freezes them
until the resume. Each worker of the model follows it at its heartbeat, and one that starts
later reads it with its model. Jobs sent meanwhile wait in the queue: nothing is lost. A call
returns once every serving worker of the model says, in its heartbeat, that it acted on it
(paused: its running requests ended, or are frozen).
"""

from __future__ import annotations

import time

from api.cluster import Cluster
from api.lora_adapters import confirm
from api.weights_updates import model_of, write_command
from producer.async_client import AsyncClient
from producer.records import WorkerInfo

CONFIRM_PAUSE_S = 300.0  # a pause with mode "wait" waits for the running requests to end


async def command(client: AsyncClient, cluster: Cluster, model: str | None, mode: str | None) -> str:
    """Pause the model's workers (`mode` "abort", "wait" or "keep") or resume them (None), and
    wait until each serving one acted on it; the model's name."""
    name = await model_of(cluster, model)
    fields: dict[str, str | int] = {"paused": int(mode is not None), "mode": mode or "abort"}
    count = await write_command(client, cluster, client.keys.pause(name), fields)

    def done(_: str, info: WorkerInfo) -> bool:
        return info.pause_command >= count

    await confirm(cluster, time.time(), done, f"paused (mode {mode})" if mode else "resumed",
                  applies=lambda info: info.model == name, timeout_s=CONFIRM_PAUSE_S)
    return name


async def is_paused(cluster: Cluster, model: str | None) -> bool:
    """Whether every serving worker of the model is paused (and one is)."""
    name = await model_of(cluster, model)
    paused = [w.info.paused for w in await cluster.workers() if w.serving and w.info.model == name]
    return bool(paused) and all(paused)
