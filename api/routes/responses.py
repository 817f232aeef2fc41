"""`POST /v1/responses`: OpenAI's Responses API, run as a chat completion (api.responses_api)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from api import generate, responses_api
from api.deps import StateDep
from api.errors import APIError
from api.responses_api import ResponseRenderer, ResponsesRequest
from api.routes.chat import chat_prompt, check_tool_parser
from api.sse import EventStreamResponse, unless_disconnected

router = APIRouter(tags=["openai"])


@router.post("/responses")
async def create_response(body: ResponsesRequest, request: Request, state: StateDep):
    """Input items in, output items out; `stream: true` answers with the Responses events."""
    renderer = ResponseRenderer()
    try:
        chat = responses_api.to_chat(body)
        check_tool_parser(chat, state.settings)
        req = await generate.start(state, chat, [chat_prompt(chat)], renderer)
    except APIError as exc:
        raise responses_api.renamed(exc) from None
    if body.stream:
        return EventStreamResponse(responses_api.stream(state, body, req))
    finished = await unless_disconnected(request, generate.collect(state, req, renderer))
    return JSONResponse(responses_api.response_object(body, finished))
