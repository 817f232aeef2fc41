"""Weights updates, cluster-wide (SGLang's POST /update_weights_from_disk): every worker of a
model serves the weights of another checkpoint of it (a training step's, a fine-tune's)
without starting over, behind GENQ_SERVER_DEV_MODE.

The update is the hash `genq:weights:<model>` (producer.records.WeightsUpdate): a count, the
checkpoint's path on the workers' disks, and a mode. Each worker of the model follows it at
its heartbeat, and one that starts later reads it with its model, so the whole fleet serves
one set of weights. The call returns once every serving worker of the model says, in its
heartbeat, that it serves the update, so a job sent after it runs on the new weights; a worker
that could not read the checkpoint serves the weights it had, and its reason is the error.
The update is all or nothing: where a worker could not, it is taken back, so a worker that
starts later does not try it either, and the workers that could serve the weights before it
again (a later update of their own), so the fleet never answers with two sets of weights.
"""

from __future__ import annotations

import time

from api.cluster import Cluster
from api.errors import APIError, invalid_param
from api.lora_adapters import confirm
from producer.async_client import AsyncClient
from producer.records import WeightsUpdate, WorkerInfo


async def update(client: AsyncClient, cluster: Cluster, model_path: str, model: str | None, mode: str,
                 timeout_s: float) -> dict[str, object]:
    """Record the update and wait until every serving worker of the model serves it."""
    if not model_path.strip():
        raise invalid_param("model_path", "model_path must name the checkpoint's directory on the workers")
    name = await model_of(cluster, model)
    key = client.keys.weights(name)
    before = WeightsUpdate.from_hash(await client.redis.hgetall(key))  # type: ignore[misc]
    count = await write_command(client, cluster, key, {"model_path": model_path, "mode": mode})
    served: set[str] = set()
    failed: dict[str, str] = {}

    def done(worker: str, info: WorkerInfo) -> bool:
        if info.weights_update >= count and not (info.weights_update == count and info.weights_error):
            served.add(worker)
        elif info.weights_update == count:
            failed[worker] = f"{info.weights_error} (it serves {info.weights_path} on)"
        return worker in served or worker in failed

    await confirm(cluster, time.time(), done, f"serve the weights of {model_path}",
                  applies=lambda info: info.model == name, timeout_s=timeout_s)
    if failed:
        refused = "; ".join(f"Worker {w} cannot serve the weights of {model_path}: {why}"
                            for w, why in sorted(failed.items()))
        back = await _take_back(client, key, count, before, reload=bool(served))
        said = "" if back is None else " The update is taken back: a worker that starts serves the weights before it."
        if back is not None and served:
            await cluster.notify(key)
            said += await _served_again(cluster, name, back, before, served, timeout_s)
        raise APIError(400, refused + said, param="model_path")
    workers = f"{len(served)} worker{'s' if len(served) != 1 else ''}" if served else \
        "no worker is live; workers serve them as they start"
    return {"success": True, "message": f"Model {name} serves the weights of {model_path} ({workers}).",
            "model": name, "model_path": model_path, "weights_update": count}


# A command's hash: its fields, and its count one more (KEYS[1]; ARGV: field, value, ...). One
# script, so no worker sees the count move before the fields (and on a Redis Cluster too, which
# has no MULTI in redis-py). Returns the count.
WRITE_COMMAND_LUA = """
redis.call('HSET', KEYS[1], unpack(ARGV))
return redis.call('HINCRBY', KEYS[1], 'count', 1)
"""

# Take an update back (KEYS[1], its hash) unless a later one came: where its count is still
# ARGV[1], the count one more if ARGV[2] is '1', and model_path ARGV[3], mode ARGV[4]. Returns
# 1, or 0 where a later update came.
TAKE_BACK_LUA = """
if tonumber(redis.call('HGET', KEYS[1], 'count') or '0') ~= tonumber(ARGV[1]) then return 0 end
if ARGV[2] == '1' then redis.call('HINCRBY', KEYS[1], 'count', 1) end
redis.call('HSET', KEYS[1], 'model_path', ARGV[3], 'mode', ARGV[4])
return 1
"""


async def write_command(client: AsyncClient, cluster: Cluster, key: str, fields: dict[str, str | int]) -> int:
    """A command the workers follow (a weights update, a sleep, a pause): its hash's count one
    more and its fields (WRITE_COMMAND_LUA), and the workers told; the count."""
    pairs = [x for field, value in fields.items() for x in (field, value)]
    count = await client.redis.eval(WRITE_COMMAND_LUA, 1, key, *pairs)  # type: ignore[misc]
    await cluster.notify(key)
    return int(count)


async def _take_back(client: AsyncClient, key: str, count: int, before: WeightsUpdate | None,
                     reload: bool) -> int | None:
    """Point the update `count`, which a worker could not serve, back at the checkpoint before
    it (the model's own, "", where there was none), unless a later update came meanwhile; the
    count then, None where a later update came. Where no worker served it (not `reload`), its
    count stays: no worker reloads what it serves already, one that starts reads the one before;
    where some did, the count moves on, so they load the one before again."""
    taken = await client.redis.eval(TAKE_BACK_LUA, 1, key, count, int(reload),  # type: ignore[misc]
                                    before.model_path if before else "", before.mode if before else "wait")
    return count + reload if taken else None


async def _served_again(cluster: Cluster, name: str, count: int, before: WeightsUpdate | None,
                        served: set[str], timeout_s: float) -> str:
    """Wait until the workers that served the update taken back serve the weights before it
    (update `count`); what to add to the error."""
    again: set[str] = set()
    failed: dict[str, str] = {}

    def done(worker: str, info: WorkerInfo) -> bool:
        if worker not in served:  # (it serves them already, or started since: it read them)
            return True
        if info.weights_update >= count and (info.weights_update > count or not info.weights_error):
            again.add(worker)
        elif info.weights_update == count:
            failed[worker] = info.weights_error
        return worker in again or worker in failed

    weights = before.model_path if before and before.model_path else "the model's own weights"
    await confirm(cluster, time.time(), done, f"serve {weights} again",
                  applies=lambda info: info.model == name, timeout_s=timeout_s)
    return (f" Workers {', '.join(sorted(again))} serve {weights} again." if again else "") + "".join(
        f" Worker {w} cannot serve {weights} again: {why}." for w, why in sorted(failed.items()))


async def model_of(cluster: Cluster, model: str | None) -> str:
    """The model the update is for: the one named (or aliased), or the only one served. A name
    no live worker serves as its model (an adapter's, a typo) is a 404, unless none is live:
    then the update waits for the workers that start."""
    bases = sorted({w.info.model for w in await cluster.workers() if w.serving})
    if model is not None:
        name = await cluster.model_named(model)
        if bases and name not in bases:
            raise APIError(404, f"The model `{model}` does not exist (served: {', '.join(bases)}).", param="model",
                           code="model_not_found")
        return name
    if len(bases) != 1:
        raise invalid_param("model", "several models are served (" + ", ".join(bases) + "): name one"
                            if bases else "no worker is live to say which model: name one")
    return bases[0]
