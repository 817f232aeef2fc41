"""OpenAI's Conversations API (`/v1/conversations`): a conversation is a list of Responses items
kept in Redis, and `POST /v1/responses` with `conversation` runs on them: its input follows the
conversation's items, and once it ends its input and output items are added to it.

`conversation(id)` holds the object (JSON: id, created_at, metadata) and
`conversation_items(id)` the items, oldest first (JSON each, with its id); both are kept
GENQ_FILE_TTL_S after the last change. A response adds its turn once however many API
processes finish it (`conversation_turn(id, response id)`, SET NX).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from api.deps import AppState
from api.errors import APIError, invalid_param, not_found
from api.stored_responses import load_json
from producer.redis_conn import ordered_writes

MAX_ITEMS_PER_CALL = 20  # as OpenAI: items in one create or add
MAX_METADATA = 16  # keys, as OpenAI's metadata
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def conversation_id(value: str | dict[str, Any] | None) -> str | None:
    """The id a Responses request's `conversation` names (a string, or {"id": ...})."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("id"), str):
        return str(value["id"])
    raise invalid_param("conversation", "conversation must be a conversation id or {\"id\": ...}")


def as_items(items: Any, where: str, roles: tuple[str, ...] = ("user", "assistant", "system", "developer")
             ) -> list[dict[str, Any]]:
    """Input items as a conversation keeps them: each with an id and a type, a message's text
    as content parts; 400 naming the item for a type or a role (not in `roles`) it cannot
    keep. (What a response makes of their content, responses_api.as_messages checks.)"""
    if not isinstance(items, list):
        raise invalid_param(where, f"{where} must be a list of items")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise invalid_param(f"{where}[{i}]", "an item must be an object")
        kind = item.get("type", "message")
        if kind not in _ID_PREFIX:
            raise invalid_param(f"{where}[{i}].type", f"items of type {kind!r} are not supported "
                                f"({', '.join(_ID_PREFIX)})")
        kept = {**item, "type": kind, "id": item.get("id") or f"{_ID_PREFIX[kind]}_{uuid.uuid4().hex}"}
        if kind == "message":
            role, content = item.get("role"), item.get("content")
            if roles and role not in roles:
                raise invalid_param(f"{where}[{i}].role", f"role must be {', '.join(roles)}")
            if isinstance(content, str):
                content = [{"type": "output_text" if role == "assistant" else "input_text", "text": content}]
            kept |= {"role": role, "content": content, "status": item.get("status", "completed")}
        out.append(kept)
    return out


def request_items(request_input: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A Responses request's input as conversation items, as to_chat took it (whatever roles
    its messages have: its response has run by now)."""
    items = [{"role": "user", "content": request_input}] if isinstance(request_input, str) else request_input
    return as_items(items, "input", roles=())


async def create(state: AppState, kept: list[dict[str, Any]], metadata: dict[str, str] | None) -> dict[str, Any]:
    """A new conversation holding checked items (as_items)."""
    conv_id = f"conv_{uuid.uuid4().hex}"
    obj = {"id": conv_id, "object": "conversation", "created_at": int(time.time()), "metadata": _metadata(metadata)}
    keys, ttl = state.client.keys, state.settings.file_ttl_s
    pipe = ordered_writes(state.client.redis)
    if kept:
        pipe.rpush(keys.conversation_items(conv_id), *(json.dumps(item) for item in kept))
        pipe.expire(keys.conversation_items(conv_id), ttl)
    pipe.set(keys.conversation(conv_id), json.dumps(obj), ex=ttl)  # (last: the conversation is there)
    await pipe.execute()
    return obj


async def load(state: AppState, conv_id: str, param: str | None = None) -> dict[str, Any]:
    return await load_json(state, state.client.keys.conversation(conv_id), _missing(conv_id, param))


def _missing(conv_id: str, param: str | None = None) -> APIError:
    return not_found(f"No conversation {conv_id!r} (never created, deleted, or expired).", "conversation_not_found",
                     param)


async def update(state: AppState, conv_id: str, metadata: dict[str, str] | None) -> dict[str, Any]:
    obj = {**await load(state, conv_id), "metadata": _metadata(metadata)}
    await state.client.redis.set(state.client.keys.conversation(conv_id), json.dumps(obj),
                                 ex=state.settings.file_ttl_s)
    return obj


async def delete(state: AppState, conv_id: str) -> dict[str, Any]:
    keys = state.client.keys
    if not await state.client.redis.delete(keys.conversation(conv_id), keys.conversation_items(conv_id)):
        raise _missing(conv_id)
    return {"id": conv_id, "object": "conversation.deleted", "deleted": True}


async def items(state: AppState, conv_id: str, param: str | None = None) -> list[dict[str, Any]]:
    """Every item, oldest first (404 for a conversation that is gone)."""
    await load(state, conv_id, param)
    raw = await state.client.redis.lrange(state.client.keys.conversation_items(conv_id), 0, -1)  # type: ignore[misc]
    return [json.loads(r) for r in raw]


async def add(state: AppState, conv_id: str, new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Append checked items (as_items) and keep the conversation for another file TTL."""
    await load(state, conv_id)
    if new:
        await _append(state, conv_id, new)
    return new


async def add_turn(state: AppState, conv_id: str, response_id: str, new: list[dict[str, Any]]) -> None:
    """A response's input and output items, once per response."""
    keys = state.client.keys
    if await state.client.redis.set(keys.conversation_turn(conv_id, response_id), 1, nx=True,
                                    ex=state.settings.file_ttl_s):
        await _append(state, conv_id, new)


async def _append(state: AppState, conv_id: str, new: list[dict[str, Any]]) -> None:
    keys, ttl = state.client.keys, state.settings.file_ttl_s
    pipe = ordered_writes(state.client.redis)
    pipe.rpush(keys.conversation_items(conv_id), *(json.dumps(item) for item in new))
    pipe.expire(keys.conversation_items(conv_id), ttl)
    pipe.expire(keys.conversation(conv_id), ttl)
    await pipe.execute()


async def remove(state: AppState, conv_id: str, item_id: str) -> dict[str, Any]:
    """Delete one item; the conversation object is the answer, as OpenAI's."""
    obj = await load(state, conv_id)
    key = state.client.keys.conversation_items(conv_id)
    for raw in await state.client.redis.lrange(key, 0, -1):  # type: ignore[misc]
        if json.loads(raw).get("id") == item_id:
            await state.client.redis.lrem(key, 1, raw)  # type: ignore[misc]
            return obj
    raise _no_item(conv_id, item_id)


def page(all_items: list[dict[str, Any]], limit: int, order: str, after: str | None) -> dict[str, Any]:
    """One page of a list of items, OpenAI's list shape."""
    if not 1 <= limit <= 100:
        raise invalid_param("limit", f"limit must be 1 to 100, got {limit}")
    if order not in ("asc", "desc"):
        raise invalid_param("order", f"order must be asc or desc, got {order!r}")
    ordered = all_items if order == "asc" else all_items[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise invalid_param("after", f"no item {after!r} in this conversation")
        ordered = ordered[ids.index(after) + 1:]
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}


def find(all_items: list[dict[str, Any]], conv_id: str, item_id: str) -> dict[str, Any]:
    for item in all_items:
        if item["id"] == item_id:
            return item
    raise _no_item(conv_id, item_id)


def _no_item(conv_id: str, item_id: str) -> APIError:
    return not_found(f"No item {item_id!r} in conversation {conv_id!r}.", "item_not_found")


def _metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA or not all(isinstance(v, str) for v in metadata.values()):
        raise invalid_param("metadata", f"metadata is at most {MAX_METADATA} string values")
    return metadata
