"""`POST /v1/completions` (api.completions)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api import completions
from api.deps import StateDep
from api.request_bodies import CompletionRequest
from api.response_bodies import CompletionResponse

router = APIRouter(tags=["openai"])


@router.post("/completions", response_model=CompletionResponse)
async def create_completion(body: CompletionRequest, request: Request, state: StateDep):
    """Prompt(s) as text or token ids; `stream: true` answers with SSE chunks."""
    return await completions.respond(state, body, request)
