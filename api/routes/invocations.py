"""`POST /invocations`, as vLLM serves it for SageMaker: one route for every endpoint, chosen by
the body's shape (`messages`: chat, `prompt`: completions, `text_1`/`text_2`: score,
`query`/`documents`: rerank, `input`: embeddings)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from api import chat, completions, pooling
from api.deps import StateDep
from api.errors import invalid_param
from api.pooling import RerankRequest, ScoreRequest
from api.request_bodies import ChatCompletionRequest, CompletionRequest, EmbeddingRequest

router = APIRouter(tags=["vllm"])

# (the fields that mark a body, its request model, the service the endpoint's route calls), first match wins
ENDPOINTS: list[tuple[tuple[str, ...], type[BaseModel], Any]] = [
    (("messages",), ChatCompletionRequest, chat.respond),
    (("prompt",), CompletionRequest, completions.respond),
    (("text_1", "text_2"), ScoreRequest, pooling.score),
    (("query", "documents"), RerankRequest, pooling.rerank),
    (("input",), EmbeddingRequest, pooling.embeddings_response),
]


@router.post("/invocations")
async def invocations(request: Request, state: StateDep, body: Annotated[dict[str, Any], Body()]) -> Any:
    for fields, model, endpoint in ENDPOINTS:
        if all(field in body for field in fields):
            try:
                parsed = model.model_validate(body)
            except ValidationError as exc:  # answered as the endpoint itself answers it
                raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
            return await endpoint(state, parsed, request)
    raise invalid_param("body", "cannot tell which endpoint the body is for: it needs messages (chat), prompt "
                        "(completions), text_1 and text_2 (score), query and documents (rerank), or input (embeddings)")
