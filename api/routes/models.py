"""`GET /v1/models` and `GET /v1/models/{model}`: the models live workers serve (from their
heartbeats), in OpenAI's shape, or in Anthropic's for Anthropic's clients (which send
`anthropic-version`)."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from api.api_keys import PLAN
from api.deps import StateDep
from api.errors import APIError
from api.response_bodies import ModelCard, ModelList

router = APIRouter(tags=["openai"])


@router.get("/models", response_model=ModelList)
async def list_models(request: Request, state: StateDep) -> Any:
    """One card per served model name; the configured fallback when no worker is live."""
    cards = list((await _cards(state)).values())
    if anthropic_client(request):  # one page holds them all
        data = [_anthropic_model(card) for card in cards]
        first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
        return JSONResponse({"data": data, "has_more": False, "first_id": first, "last_id": last})
    return ModelList(data=cards)


@router.get("/models/{model}", response_model=ModelCard)
async def retrieve_model(model: str, request: Request, state: StateDep) -> Any:
    """One card; 404 `model_not_found` for a name no live worker serves."""
    card = (await _cards(state)).get(model)
    if card is None:
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
    return JSONResponse(_anthropic_model(card)) if anthropic_client(request) else card


def anthropic_client(request: Request) -> bool:
    return "anthropic-version" in request.headers


def _anthropic_model(card: ModelCard) -> dict[str, Any]:
    created = datetime.fromtimestamp(card.created, timezone.utc).isoformat().replace("+00:00", "Z")
    return {"type": "model", "id": card.id, "display_name": card.id, "created_at": created}


async def _cards(state: StateDep) -> dict[str, ModelCard]:
    """Base models (under each of their names) and their LoRA adapters (whose `parent` is the
    base model); the shared stream's model first (a request naming none runs there), then by
    name."""
    cards: dict[str, ModelCard] = {}
    plan = PLAN.get()  # a managed key sees the models it may use
    workers = sorted(await state.cluster.workers(), key=lambda w: (w.info.queue != "", w.info.model, w.name))
    for worker in workers:
        info = worker.info
        if not worker.serving or not info.model:
            continue
        for name, parent in [(n, None) for n in info.names] + [(a, info.model) for a in info.adapters]:
            if plan is not None and not plan.allows(name):
                continue
            card = cards.setdefault(name, ModelCard(id=name, created=int(info.started_at), parent=parent))
            card.workers += 1
            card.created = min(card.created, int(info.started_at))
            if info.max_model_len:  # a job may land on any of them: the smallest bounds it
                card.max_model_len = min(card.max_model_len or info.max_model_len, info.max_model_len)
    name = state.settings.served_model_name
    if not cards and (plan is None or plan.allows(name)):
        cards[name] = ModelCard(id=name, created=int(time.time()))
    return cards
