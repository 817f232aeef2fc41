"""vLLM's development endpoints, mounted only with GENQ_SERVER_DEV_MODE (as vLLM mounts them
with VLLM_SERVER_DEV_MODE): what a benchmark needs between runs, which no tenant should be
able to do to the others' traffic on a shared deployment."""

from __future__ import annotations

from fastapi import APIRouter, Response

from api.deps import StateDep

router = APIRouter(tags=["dev"])


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(state: StateDep) -> Response:
    """Every worker empties its prefix cache at its next heartbeat (the count in Redis it
    follows moves); 200 once asked."""
    await state.client.redis.incr(state.client.keys.prefix_cache_resets)
    return Response(status_code=200)
