"""`POST /v1/responses`: OpenAI's Responses API, run as a chat completion (api.responses_api)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from api import background_responses, conversations, generate, responses_api, stored_responses
from api.chat import start
from api.conversations import conversation_id
from api.deps import StateDep
from api.errors import APIError, invalid_param, renamed
from api.responses_api import ResponseRenderer, ResponsesRequest, as_messages
from api.sse import EventStreamResponse, unless_disconnected

router = APIRouter(tags=["openai"])


@router.post("/responses")
async def create_response(body: ResponsesRequest, request: Request, state: StateDep):
    """Input items in, output items out; `stream: true` answers with the Responses events."""
    renderer = ResponseRenderer()
    previous, conv_id = body.previous_response_id, conversation_id(body.conversation)
    if previous is not None and conv_id is not None:
        raise invalid_param("conversation", "conversation and previous_response_id cannot be used together")
    history = await stored_responses.history(state, previous) if previous is not None else None
    if conv_id is not None:  # (its items were checked as they were added)
        history = as_messages(await conversations.items(state, conv_id, "conversation"), "conversation")
    if body.background and not body.store:
        raise invalid_param("store", "background responses are stored: store must be true")
    try:
        chat = responses_api.to_chat(body, history)
        req = await start(state, chat, renderer)
    except APIError as exc:
        raise renamed(exc, responses_api.PARAMS) from None
    if body.background:
        record = await background_responses.start(state, body, chat, req)
        if body.stream:  # the job runs on if the client goes; GET ...?stream=true resumes
            return EventStreamResponse(background_responses.replay(state, record))
        return JSONResponse(record["response"])
    if body.stream:
        return EventStreamResponse(responses_api.stream(state, body, req, chat))
    finished = await unless_disconnected(request, generate.collect(state, req, renderer))
    return JSONResponse(await responses_api.finish(state, body, chat, finished))


@router.get("/responses/{response_id}")
async def retrieve_response(
    response_id: str, state: StateDep, stream: bool = False, starting_after: int = -1
):
    """A stored response (`store` was not false), as it was returned; a background one as it
    stands now, or (`stream=true`) its events again, after `starting_after` if given."""
    stored = await stored_responses.load(state, response_id)
    if stream:
        return EventStreamResponse(background_responses.replay(state, stored, starting_after))
    return JSONResponse(await background_responses.current(state, stored))


@router.get("/responses/{response_id}/input_items")
async def list_input_items(response_id: str, state: StateDep, limit: int = 20, order: str = "desc",
                           after: str | None = None) -> JSONResponse:
    """The items a stored response was given, in pages as a conversation's."""
    stored = await stored_responses.load(state, response_id)
    return JSONResponse(conversations.page(background_responses.input_items(stored), limit, order, after))


@router.post("/responses/{response_id}/cancel")
async def cancel_response(response_id: str, state: StateDep) -> JSONResponse:
    """Cancel a background response: its job stops, and it is `cancelled` (or as it ended)."""
    return JSONResponse(await background_responses.cancel(state, await stored_responses.load(state, response_id)))


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str, state: StateDep) -> JSONResponse:
    return JSONResponse(await stored_responses.delete(state, response_id))
