"""Loading and unloading LoRA adapters at run time, cluster-wide (vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter, behind the same opt-in).

The registry is the hash `genq:lora_adapters` (name -> path on the workers' disks). Every
LoRA-enabled worker follows it at each heartbeat and reports, in that heartbeat, the adapters
it serves and those it could not load. A load succeeds once every serving worker serves the
adapter; if any cannot load it, the entry is taken back and the worker's reason is the
error, so a job never lands on a worker that lacks its adapter. An unload returns once no
worker lists it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from api.cluster import Cluster
from api.errors import APIError, invalid_param
from producer.async_client import AsyncClient
from producer.records import WorkerInfo

CONFIRM_TIMEOUT_S = 60.0  # workers read Redis each heartbeat (5 s by default)
POLL_S = 0.1


async def load(client: AsyncClient, cluster: Cluster, name: str, path: str) -> str:
    """Register the adapter and wait until every serving worker serves it."""
    _check_name(name)
    if not path.strip():
        raise invalid_param("lora_path", "lora_path must name the adapter's directory on the workers")
    workers = await _serving(cluster)
    without = [w for w, info in workers.items() if not info.max_loras]
    if without:
        raise APIError(400, f"Workers {', '.join(sorted(without))} do not serve LoRA adapters (start them with "
                       "--enable-lora): a job for the adapter could land on them.", param="lora_name")
    taken = set(await cluster.served_models()) | {k.decode() for k in await client.redis.hkeys(client.keys.lora_adapters)}
    if name in taken or not await client.redis.hsetnx(client.keys.lora_adapters, name, path):
        raise invalid_param("lora_name", f"The lora adapter '{name}' has already been loaded.")
    since = time.time()
    await cluster.notify(client.keys.lora_adapters)
    try:
        await _confirm(cluster, since, lambda _, info: _loaded(info, name), f"load LoRA adapter '{name}'")
    except APIError:
        await client.redis.hdel(client.keys.lora_adapters, name)
        raise
    if not workers:
        return f"Success: LoRA adapter '{name}' registered; no worker is live, so workers load it as they start."
    return f"Success: LoRA adapter '{name}' added successfully."


async def unload(client: AsyncClient, cluster: Cluster, name: str) -> str:
    """Take the adapter out of the registry and wait until no serving worker serves it."""
    if not await client.redis.hdel(client.keys.lora_adapters, name):
        configured = name in await cluster.served_models()
        why = "was given to the workers at start (--lora-modules)" if configured else "cannot be found"
        raise invalid_param("lora_name", f"The lora adapter '{name}' {why}.")
    await cluster.notify(client.keys.lora_adapters)
    await _confirm(cluster, time.time(), lambda _, info: name not in info.adapters,
                   f"unload LoRA adapter '{name}'")
    return f"Success: LoRA adapter '{name}' removed successfully."


def _check_name(name: str) -> None:
    if not name or name.strip() != name or "," in name or "=" in name:
        raise invalid_param("lora_name", f"lora_name must be non-empty, without commas, '=' or edge spaces, got {name!r}")


async def _serving(cluster: Cluster) -> dict[str, WorkerInfo]:
    return {w.name: w.info for w in await cluster.workers() if w.serving}


def _loaded(info: WorkerInfo, name: str) -> bool:
    """True once `info` serves the adapter; APIError if it could not load it."""
    error = info.adapter_errors.get(name)
    if error is not None:
        raise APIError(400, f"A worker cannot load LoRA adapter '{name}': {error}", param="lora_path")
    return name in info.adapters


async def _confirm(cluster: Cluster, since: float, done, what: str) -> None:
    """Until the heartbeat after `since` of every serving worker with LoRA on says `done`."""
    await confirm(cluster, since, done, what, applies=lambda info: bool(info.max_loras))


async def confirm(cluster: Cluster, since: float, done: Callable[[str, WorkerInfo], bool], what: str,
                  applies: Callable[[WorkerInfo], bool] = lambda info: True,
                  timeout_s: float = CONFIRM_TIMEOUT_S) -> None:
    """Until the heartbeat after `since` of every serving worker it `applies` to says `done`
    (asked with the worker's name); 504 naming the others after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        pending = [n for n, info in (await _serving(cluster)).items()
                   if applies(info) and (info.heartbeat_at < since or not done(n, info))]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise APIError(504, f"Workers {', '.join(sorted(pending))} did not confirm within "
                           f"{timeout_s:g} s that they {what}.", type="timeout", code="timeout")
        await asyncio.sleep(POLL_S)
