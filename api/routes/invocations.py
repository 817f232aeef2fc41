"""`POST /invocations`, as vLLM serves it for SageMaker: one route for every endpoint, chosen by
the body's shape (`messages`: chat, `prompt`: completions, `text_1`/`text_2`: score,
`query`/`documents`: rerank, `input`: embeddings)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from api.deps import StateDep
from api.errors import invalid_param
from api.request_bodies import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from api.routes import chat, completions, embeddings, scores

router = APIRouter(tags=["vllm"])

# (the fields that mark a body, its request model, the endpoint's function), first match wins
ENDPOINTS: list[tuple[tuple[str, ...], type[BaseModel], Any]] = [
    (("messages",), ChatCompletionRequest, chat.create_chat_completion),
    (("prompt",), CompletionRequest, completions.create_completion),
    (("text_1", "text_2"), scores.ScoreRequest, scores.score),
    (("query", "documents"), scores.RerankRequest, scores.rerank),
    (("input",), EmbeddingRequest, embeddings.create_embeddings),
]


@router.post("/invocations")
async def invocations(request: Request, state: StateDep, body: Annotated[dict[str, Any], Body()]) -> Any:
    for fields, model, endpoint in ENDPOINTS:
        if all(field in body for field in fields):
            try:
                parsed = model.model_validate(body)
            except ValidationError as exc:  # answered as the endpoint itself answers it
                raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
            return await endpoint(parsed, request, state)
    raise invalid_param("body", "cannot tell which endpoint the body is for: it needs messages (chat), prompt "
                        "(completions), text_1 and text_2 (score), query and documents (rerank), or input (embeddings)")
