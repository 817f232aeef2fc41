"""`/v1/conversations`: OpenAI's Conversations API (api.conversations), whose conversations
`POST /v1/responses` runs on with `conversation`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel

from api import conversations
from api.conversations import MAX_ITEMS_PER_CALL
from api.deps import StateDep
from api.errors import invalid_param
from api.responses_api import as_messages

router = APIRouter(tags=["openai"])


class CreateConversation(BaseModel):
    items: list[Any] | None = None
    metadata: dict[str, Any] | None = None


class UpdateConversation(BaseModel):
    metadata: dict[str, Any] | None = None


class AddItems(BaseModel):
    items: list[Any]


def checked(items: list[Any] | None, where: str) -> list[dict[str, Any]]:
    """Items to keep; 400 naming the item for one a response could not read back."""
    kept = conversations.as_items(items or [], where)
    if len(kept) > MAX_ITEMS_PER_CALL:
        raise invalid_param(where, f"at most {MAX_ITEMS_PER_CALL} items may be added at once")
    as_messages(kept, where)
    return kept


@router.post("/conversations")
async def create_conversation(body: CreateConversation, state: StateDep) -> dict[str, Any]:
    return await conversations.create(state, checked(body.items, "items"), body.metadata)


@router.get("/conversations/{conv_id}")
async def retrieve_conversation(conv_id: str, state: StateDep) -> dict[str, Any]:
    return await conversations.load(state, conv_id)


@router.post("/conversations/{conv_id}")
async def update_conversation(conv_id: str, body: UpdateConversation, state: StateDep) -> dict[str, Any]:
    return await conversations.update(state, conv_id, body.metadata)


@router.delete("/conversations/{conv_id}")
async def delete_conversation(conv_id: str, state: StateDep) -> dict[str, Any]:
    return await conversations.delete(state, conv_id)


@router.post("/conversations/{conv_id}/items")
async def add_items(conv_id: str, body: AddItems, state: StateDep) -> dict[str, Any]:
    added = await conversations.add(state, conv_id, checked(body.items, "items"))
    return {"object": "list", "data": added, "first_id": added[0]["id"] if added else None,
            "last_id": added[-1]["id"] if added else None, "has_more": False}


@router.get("/conversations/{conv_id}/items")
async def list_items(conv_id: str, state: StateDep, limit: int = 20, order: str = "desc",
                     after: str | None = None) -> dict[str, Any]:
    return conversations.page(await conversations.items(state, conv_id), limit, order, after)


@router.get("/conversations/{conv_id}/items/{item_id}")
async def retrieve_item(conv_id: str, item_id: str, state: StateDep) -> dict[str, Any]:
    return conversations.find(await conversations.items(state, conv_id), conv_id, item_id)


@router.delete("/conversations/{conv_id}/items/{item_id}")
async def delete_item(conv_id: str, item_id: str, state: StateDep) -> dict[str, Any]:
    return await conversations.remove(state, conv_id, item_id)
