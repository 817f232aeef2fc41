"""vLLM's development endpoints, mounted only with GENQ_SERVER_DEV_MODE (as vLLM mounts them
with VLLM_SERVER_DEV_MODE): what a benchmark needs between runs, which no tenant should be
able to do to the others' traffic on a shared deployment."""

from __future__ import annotations

import time

from fastapi import APIRouter, Response

from api.deps import StateDep
from api.lora_adapters import confirm

router = APIRouter(tags=["dev"])


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(state: StateDep) -> Response:
    """Every serving worker empties its prefix cache at its next heartbeat (the count in Redis
    it follows moves); 200 once each has said so (a job sent after that finds no prefix from
    before), 504 naming those that did not."""
    since = time.time()
    count = await state.client.redis.incr(state.client.keys.prefix_cache_resets)
    await confirm(state.cluster, since, lambda info: info.prefix_cache_resets >= count, "emptied their prefix cache")
    return Response(status_code=200)
