"""vLLM's `/score` and `/rerank` (also under `/v1`, and `/v2/rerank`, the Cohere and Jina
shapes) for embedding models, and vLLM's `/classify` for classification models: each text is
embedded once, by ordinary embedding jobs (api.pooling)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from api import pooling
from api.deps import StateDep
from api.pooling import ClassificationRequest, RerankRequest, ScoreRequest

router = APIRouter(tags=["vllm"])


@router.post("/classify")
@router.post("/v1/classify")
async def classify(body: ClassificationRequest, request: Request, state: StateDep) -> dict[str, Any]:
    return await pooling.classify(state, body, request)


@router.post("/score")
@router.post("/v1/score")
async def score(body: ScoreRequest, request: Request, state: StateDep) -> dict[str, Any]:
    return await pooling.score(state, body, request)


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankRequest, request: Request, state: StateDep) -> dict[str, Any]:
    return await pooling.rerank(state, body, request)
