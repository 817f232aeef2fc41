"""Stored responses (the Responses API's `store`, on by default): each finished response is kept
in Redis with the conversation that led to it, as chat messages, so a later request can
continue it with `previous_response_id` and `GET /v1/responses/{id}` can return it. Kept for
`GENQ_FILE_TTL_S`. A previous response's `instructions` are not carried over, as OpenAI's
are not.
"""

from __future__ import annotations

import json
from typing import Any

from api.deps import AppState
from api.errors import APIError, not_found
from api.request_bodies import ChatCompletionRequest


async def save(
    state: AppState, response: dict[str, Any], chat: ChatCompletionRequest, instructions: bool,
    input_items: list[dict[str, Any]], background: dict[str, Any] | None = None,
) -> None:
    """`response` with its conversation: `chat`'s messages (without the instructions, when
    the request had them) and the response as the assistant's turn; its request's input as
    items (`GET /v1/responses/{id}/input_items`); for a background response, what replaying
    its stream needs, marked done."""
    messages = [m.model_dump(exclude_none=True) for m in chat.messages][1 if instructions else 0:]
    stored: dict[str, Any] = {"response": response, "conversation": messages + as_turn(response),
                              "input_items": input_items}
    if background is not None:
        stored |= {"background": background, "done": True}
    key = state.client.keys.stored_response(response["id"])
    await state.client.redis.set(key, json.dumps(stored), ex=state.settings.file_ttl_s)


async def load(state: AppState, response_id: str, param: str | None = None) -> dict[str, Any]:
    missing = not_found(f"No response {response_id!r} (not stored, deleted, or expired).", "response_not_found", param)
    return await load_json(state, state.client.keys.stored_response(response_id), missing)


async def load_json(state: AppState, key: str, missing: APIError) -> dict[str, Any]:
    """The JSON object stored at `key`; `missing` raised when there is none."""
    raw = await state.client.redis.get(key)
    if raw is None:
        raise missing
    stored: dict[str, Any] = json.loads(raw)
    return stored


async def history(state: AppState, response_id: str) -> list[dict[str, Any]]:
    """The conversation a new request continues: 404 naming previous_response_id if gone."""
    conversation: list[dict[str, Any]] = (await load(state, response_id, "previous_response_id"))["conversation"]
    return conversation


async def delete(state: AppState, response_id: str) -> dict[str, Any]:
    if not await state.client.redis.delete(state.client.keys.stored_response(response_id)):
        raise not_found(f"No response {response_id!r} (not stored, deleted, or expired).", "response_not_found")
    return {"id": response_id, "object": "response", "deleted": True}


def as_turn(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A response's output as the assistant's chat turn: its text and its calls."""
    text = "".join(
        part.get("text", "") for item in response["output"] if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in response["output"] if item["type"] == "function_call"
    ]
    return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]

