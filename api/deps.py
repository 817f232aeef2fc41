"""FastAPI dependencies (`Annotated` aliases): the app's state, its settings, the genq client,
the relay, and the API-key check that guards every /v1 route."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Header, Request

from api.cluster import Cluster
from api.errors import APIError
from api.metrics import Metrics
from api.relay import Relay
from api.settings import Settings
from api.tokenizers import Tokenizers
from producer.async_client import AsyncClient


@dataclass(frozen=True)
class AppState:
    """What one app holds for its lifetime (built in `api.main`'s lifespan)."""

    settings: Settings
    client: AsyncClient
    relay: Relay
    cluster: Cluster
    metrics: Metrics
    tasks: set[asyncio.Task[None]] = field(default_factory=set)  # background work, cancelled at shutdown
    tokenizers: Tokenizers = field(default_factory=Tokenizers)  # for /tokenize, as workers published them


def get_state(request: Request) -> AppState:
    return request.app.state.genq


StateDep = Annotated[AppState, Depends(get_state)]


def get_settings(state: StateDep) -> Settings:
    return state.settings


def get_client(state: StateDep) -> AsyncClient:
    return state.client


def get_relay(state: StateDep) -> Relay:
    return state.relay


SettingsDep = Annotated[Settings, Depends(get_settings)]
ClientDep = Annotated[AsyncClient, Depends(get_client)]
RelayDep = Annotated[Relay, Depends(get_relay)]


def require_api_key(
    settings: SettingsDep, authorization: Annotated[str | None, Header()] = None
) -> None:
    """401 unless `Authorization: Bearer <key>` names a configured key (none configured: open)."""
    if not settings.api_keys:
        return
    scheme, _, key = (authorization or "").partition(" ")
    valid = scheme.lower() == "bearer" and any(
        secrets.compare_digest(key.strip().encode(), k.encode()) for k in settings.api_keys
    )
    if not valid:
        raise APIError(
            401, "Incorrect API key provided: send `Authorization: Bearer <key>`.",
            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
        )
