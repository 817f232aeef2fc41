"""`GET /v1/models`: the models live workers serve (from their heartbeats)."""

from __future__ import annotations

import time

from fastapi import APIRouter

from api.deps import StateDep
from api.schemas import ModelCard, ModelList

router = APIRouter(tags=["openai"])


@router.get("/models", response_model=ModelList)
async def list_models(state: StateDep) -> ModelList:
    """One card per served model name; the configured fallback when no worker is live."""
    cards: dict[str, ModelCard] = {}
    for worker in await state.cluster.workers():
        info = worker.info
        if not worker.serving or not info.model:
            continue
        card = cards.setdefault(info.model, ModelCard(id=info.model, created=int(info.started_at)))
        card.workers += 1
        card.created = min(card.created, int(info.started_at))
    if not cards:
        name = state.settings.served_model_name
        cards[name] = ModelCard(id=name, created=int(time.time()))
    return ModelList(data=list(cards.values()))
