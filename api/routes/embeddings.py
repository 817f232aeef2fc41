"""`POST /v1/embeddings`: one embedding job per input (queued, routed and run like any job),
answered once every vector is back."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request

from api import generate
from api.deps import StateDep
from api.embeddings import EmbeddingRenderer, encoded, plan_embeddings
from api.schemas import EmbeddingRequest
from api.sse import unless_disconnected

router = APIRouter(tags=["openai"])


@router.post("/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request, state: StateDep) -> dict[str, Any]:
    model = await generate.resolve_model(state, body.model)
    await generate.check_backpressure(state)
    job_model = await generate.job_model(state, body.model, model)
    planned = plan_embeddings(body, uuid.uuid4().hex, model, job_model)
    req = await generate.submit(state, planned)
    response = await unless_disconnected(request, generate.collect(state, req, EmbeddingRenderer()))
    return encoded(response, body.encoding_format)
