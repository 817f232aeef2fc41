"""`POST /v1/messages`: Anthropic's Messages API, run as a chat completion (api.messages_api);
`POST /v1/messages/count_tokens`: a request's input tokens, as the worker would read them;
`/v1/messages/batches`: Anthropic's Message Batches API (api.message_batches)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from api import batches, generate, message_batches, messages_api
from api.chat import chat_ids, start, templated
from api.deps import StateDep
from api.errors import APIError, invalid_param, renamed
from api.generate import check_rate_limit, resolve_model
from api.messages_api import CountTokensRequest, MessageRenderer, MessagesRequest
from api.sse import EventStreamResponse, unless_disconnected
from api.tokenizers import base_model

router = APIRouter(tags=["anthropic"])


@router.post("/messages")
async def create_message(body: MessagesRequest, request: Request, state: StateDep):
    """Messages in, one assistant message out; `stream: true` answers with the Messages events."""
    renderer = MessageRenderer()
    try:
        req = await start(state, messages_api.to_chat(body, messages_api.think_tags(state.settings)), renderer)
    except APIError as exc:
        raise renamed(exc, messages_api.PARAMS) from None
    if body.stream:
        return EventStreamResponse(messages_api.stream(state, body, req))
    finished = await unless_disconnected(request, generate.collect(state, req, renderer))
    return JSONResponse(messages_api.message_object(body, finished))


@router.post("/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, state: StateDep) -> dict[str, Any]:
    """The prompt's tokens: the chat template applied to the system prompt, messages and tools."""
    try:
        chat = messages_api.to_chat(body)
    except APIError as exc:
        raise renamed(exc, messages_api.PARAMS) from None
    if any(m.has_images() for m in chat.messages):
        raise invalid_param("messages", "messages with images or audio cannot be counted here: the worker widens "
                            "each image and clip into as many tokens as its size makes")
    model, _ = await base_model(state.cluster, await resolve_model(state, body.model))
    tokenizer = await state.tokenizers.get(state.client, model)
    return {"input_tokens": len(chat_ids(tokenizer, templated(chat, state.settings)))}


@router.post("/messages/batches")
async def create_message_batch(body: message_batches.CreateMessageBatch, state: StateDep) -> JSONResponse:
    """Anthropic's Message Batches API (api.message_batches): the requests run as a genq batch.
    Creating one counts against the key's requests per minute; its requests do not."""
    await check_rate_limit(state)
    return JSONResponse(await message_batches.create(state, body))


@router.get("/messages/batches")
async def list_message_batches(request: Request, state: StateDep, limit: int = 20,
                               after_id: str | None = None) -> JSONResponse:
    return JSONResponse(await message_batches.listing(state, max(1, min(limit, 1000)), after_id, _base(request)))


@router.get("/messages/batches/{batch_id}")
async def retrieve_message_batch(batch_id: str, request: Request, state: StateDep) -> JSONResponse:
    return JSONResponse(await message_batches.shown(state, await message_batches.read(state, batch_id), _base(request)))


@router.post("/messages/batches/{batch_id}/cancel")
async def cancel_message_batch(batch_id: str, request: Request, state: StateDep) -> JSONResponse:
    await message_batches.read(state, batch_id)
    return JSONResponse(await message_batches.shown(state, await batches.cancel(state, batch_id), _base(request)))


@router.delete("/messages/batches/{batch_id}")
async def delete_message_batch(batch_id: str, state: StateDep) -> JSONResponse:
    return JSONResponse(await message_batches.delete(state, await message_batches.read(state, batch_id)))


@router.get("/messages/batches/{batch_id}/results")
async def message_batch_results(batch_id: str, state: StateDep) -> Response:
    batch = await message_batches.read(state, batch_id)
    return Response(await message_batches.results(state, batch), media_type="application/x-jsonl")


def _base(request: Request) -> str:
    return str(request.base_url).rstrip("/")
