"""`POST /v1/chat/completions`: the worker applies the model's chat template."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from api import generate
from api.deps import StateDep
from api.errors import invalid_param
from api.render import ChatRenderer
from api.schemas import ChatCompletionRequest, ChatCompletionResponse, ChatMessage
from api.sse import EventStreamResponse, unless_disconnected

router = APIRouter(tags=["openai"])


@router.post("/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest, request: Request, state: StateDep):
    """Messages in, one assistant message per choice out; `stream: true` answers with SSE."""
    messages = chat_messages(body)
    renderer = ChatRenderer()
    req = await generate.start(state, body, [messages], renderer)
    if body.stream:
        return EventStreamResponse(generate.stream(state, req, renderer))
    return await unless_disconnected(request, generate.collect(state, req, renderer))


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the protocol carries them ({role, content: str}); 400 for what genq
    does not support."""
    if not body.messages:
        raise invalid_param("messages", "messages must be a non-empty list")
    if body.tools:
        raise invalid_param("tools", "tools are not supported")
    return [_message(m, i) for i, m in enumerate(body.messages)]


def _message(message: ChatMessage, i: int) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        if any(part.type != "text" or part.text is None for part in content):
            raise invalid_param(f"messages[{i}].content", "only text content parts are supported")
        content = "".join(part.text or "" for part in content)
    return {"role": message.role, "content": content or ""}
