"""vLLM's development endpoints, mounted only with GENQ_SERVER_DEV_MODE (as vLLM mounts them
with VLLM_SERVER_DEV_MODE): what a benchmark needs between runs, and what a trainer needs to
serve its latest weights (SGLang's update_weights_from_disk), to share the workers' devices
(vLLM's sleep mode) and to pause generation meanwhile (vLLM's pause), which no tenant should
be able to do to the others' traffic on a shared deployment."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, ConfigDict, Field

from api import pause, sleep_mode, weights_updates
from api.deps import StateDep
from api.lora_adapters import confirm
from producer.records import SLEEP_TAGS

router = APIRouter(tags=["dev"])


@router.post("/reset_prefix_cache", response_class=Response)  # (an empty 200)
async def reset_prefix_cache(state: StateDep) -> Response:
    """Every serving worker empties its prefix cache at its next heartbeat (the count in Redis
    it follows moves); 200 once each has said so (a job sent after that finds no prefix from
    before), 504 naming those that did not."""
    since = time.time()
    count = await state.client.redis.incr(state.client.keys.prefix_cache_resets)
    await state.cluster.notify(state.client.keys.prefix_cache_resets)
    await confirm(state.cluster, since, lambda _, info: info.prefix_cache_resets >= count, "emptied their prefix cache")
    return Response(status_code=200)


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str  # the checkpoint's directory (or GGUF file), as the workers see it
    model: str | None = None  # the served model to update; None: the only one served
    # wait: each worker lets its running requests end first, holding the jobs it takes meanwhile;
    # keep: each updates between two steps, running requests going on over the new weights
    mode: Literal["wait", "keep"] = "wait"
    timeout: float = Field(default=300.0, gt=0, le=3600)  # seconds to wait for the workers to say so


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: UpdateWeightsRequest, state: StateDep) -> dict[str, object]:
    """Every worker of the model serves the weights of the checkpoint at `model_path` (one of
    the served model's shape), and so does each that starts later: 200 once each serving one
    says so (a job sent after it runs on the new weights); 400 naming a worker that could not
    read it (it serves the weights it had), 504 naming those that did not say within `timeout`."""
    return await weights_updates.update(state.client, state.cluster, body.model_path, body.model, body.mode,
                                        body.timeout)


@router.post("/sleep", response_class=Response)
async def sleep(state: StateDep, level: Annotated[int, Query(ge=1, le=2)] = 1, model: str | None = None) -> Response:
    """vLLM's sleep mode for every worker of the model: it takes no jobs (they wait in the
    queue), lets its running ones end, and gives the KV cache's memory back (level 2: the
    weights' too). 200 once each serving one says it sleeps."""
    await sleep_mode.command(state.client, state.cluster, model, level)
    return Response(status_code=200)


@router.post("/wake_up", response_class=Response)
async def wake_up(state: StateDep, tags: Annotated[list[Literal["weights", "kv_cache"]] | None, Query()] = None,
                  model: str | None = None) -> Response:
    """Wake the model's workers: the parts `tags` names (both by default; the weights alone let a
    weights update load before the KV cache takes its memory). 200 once each serving one did."""
    await sleep_mode.command(state.client, state.cluster, model, 0, tuple(tags or SLEEP_TAGS))
    return Response(status_code=200)


@router.get("/is_sleeping")
async def is_sleeping(state: StateDep, model: str | None = None) -> dict[str, bool]:
    return {"is_sleeping": await sleep_mode.is_sleeping(state.cluster, model)}


@router.post("/pause")
async def pause_generation(state: StateDep, mode: Literal["abort", "wait", "keep"] = "abort",
                           model: str | None = None) -> dict[str, str]:
    """vLLM's pause for every worker of the model: it takes no jobs (they wait in the queue),
    and its running requests end now with finish_reason `abort` (`mode=abort`), run to their
    end (`wait`) or stay frozen until the resume (`keep`). 200 once each serving one is paused."""
    await pause.command(state.client, state.cluster, model, mode)
    return {"status": "paused"}


@router.post("/resume")
async def resume_generation(state: StateDep, model: str | None = None) -> dict[str, str]:
    """The model's workers take jobs again, and frozen requests go on. 200 once each did."""
    await pause.command(state.client, state.cluster, model, None)
    return {"status": "resumed"}


@router.get("/is_paused")
async def is_paused(state: StateDep, model: str | None = None) -> dict[str, bool]:
    return {"is_paused": await pause.is_paused(state.cluster, model)}
