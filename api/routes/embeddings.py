"""`POST /v1/embeddings`: one embedding job per input (queued, routed and run like any job),
answered once every vector is back; vLLM's `POST /pooling`, the same jobs in its shape
(api.pooling)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from api.deps import StateDep
from api.pooling import embeddings_response, pooling_response
from api.request_bodies import EmbeddingRequest

router = APIRouter(tags=["openai"])


@router.post("/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request, state: StateDep) -> dict[str, Any]:
    return await embeddings_response(state, body, request)


pooling_router = APIRouter(tags=["vllm"])


@pooling_router.post("/pooling")
async def pooling(body: EmbeddingRequest, request: Request, state: StateDep) -> dict[str, Any]:
    """vLLM's `/pooling`: each input's pooler output as it is (an embedding model's vector, a
    classifier's logits), in vLLM's shape; the inputs as /v1/embeddings takes them."""
    return await pooling_response(state, body, request)
