"""`GET /health` (and vLLM's `/ping`, SageMaker's probe), `GET /metrics` and `GET /version`
(no API key: probes and scrapers)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from api.deps import StateDep
from producer.redis_conn import REDIS_AWAY

router = APIRouter(tags=["ops"])


@router.get("/health")
@router.get("/ping")
@router.post("/ping")
async def health(state: StateDep) -> JSONResponse:
    """200 when Redis answers and at least one worker is live; 503 with the reason else."""
    try:
        await state.cluster.ping()
        workers = [w for w in await state.cluster.workers() if w.serving]
    except REDIS_AWAY as exc:
        return JSONResponse({"status": "unavailable", "reason": f"Redis unreachable: {exc}"}, 503)
    if not workers:
        return JSONResponse({"status": "unavailable", "reason": "no live worker"}, 503)
    models = sorted({w.info.model for w in workers})
    return JSONResponse({"status": "ok", "workers": len(workers), "models": models})


@router.get("/version")
async def genq_version() -> dict[str, str]:
    try:
        return {"version": version("genq")}
    except PackageNotFoundError:  # run from a checkout that was never installed
        return {"version": "unknown"}


@router.get("/metrics", response_class=PlainTextResponse)  # (Prometheus text format)
async def metrics(state: StateDep) -> Response:
    """Prometheus text format; the cluster part is read from Redis now."""
    keys = state.client.keys
    batches = await state.client.redis.scard(keys.active_batches)  # type: ignore[misc]
    webhooks = await state.client.redis.xlen(keys.webhook_outbox)
    state.metrics.cluster.update(await state.cluster.queue_depths(), await state.cluster.workers(), batches, webhooks)
    return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
