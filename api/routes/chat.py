"""`POST /v1/chat/completions`: the worker applies the model's chat template (api.chat)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api import chat
from api.deps import StateDep
from api.request_bodies import ChatCompletionRequest
from api.response_bodies import ChatCompletionResponse

router = APIRouter(tags=["openai"])


@router.post("/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest, request: Request, state: StateDep):
    """Messages in, one assistant message per choice out; `stream: true` answers with SSE."""
    return await chat.respond(state, body, request)
