"""`POST /v1/embeddings`: one embedding job per input (queued, routed and run like any job),
answered once every vector is back; vLLM's `POST /pooling`, the same jobs in its shape."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request

from api import generate
from api.deps import StateDep
from api.embeddings import EmbeddingRenderer, encoded, plan_embeddings
from api.request_bodies import EmbeddingRequest
from api.sse import unless_disconnected

router = APIRouter(tags=["openai"])


@router.post("/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request, state: StateDep) -> dict[str, Any]:
    return encoded(await _pooled(body, request, state), body.encoding_format)


async def _pooled(body: EmbeddingRequest, request: Request, state: StateDep) -> dict[str, Any]:
    """The embeddings response: one job per input, each vector as its worker pooled it."""
    model = await generate.resolve_model(state, body.model)
    await generate.check_backpressure(state)
    job_model = await generate.job_model(state, body.model, model)
    planned = plan_embeddings(body, uuid.uuid4().hex, model, job_model)
    req = await generate.submit(state, planned)
    return await unless_disconnected(request, generate.collect(state, req, EmbeddingRenderer()))


pooling_router = APIRouter(tags=["vllm"])


@pooling_router.post("/pooling")
async def pooling(body: EmbeddingRequest, request: Request, state: StateDep) -> dict[str, Any]:
    """vLLM's `/pooling`: each input's pooler output as it is (an embedding model's vector, a
    classifier's logits), in vLLM's shape; the inputs as /v1/embeddings takes them."""
    response = encoded(await _pooled(body, request, state), body.encoding_format)
    data = [{"index": item["index"], "object": "pooling", "data": item["embedding"]} for item in response["data"]]
    return {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": response["model"],
            "data": data, "usage": response["usage"]}
