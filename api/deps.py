"""FastAPI dependencies (`Annotated` aliases): the app's state, its settings, the genq client,
the relay, and the API-key check that guards every /v1 route."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Header, Request

from api import request_log
from api.api_keys import PLAN, ManagedKeys
from api.cluster import Cluster
from api.errors import APIError
from api.metrics import Metrics
from api.relay import Relay
from api.settings import Settings
from api.tokenizers import Tokenizers
from api.webhooks import Webhooks
from producer.async_client import AsyncClient
from producer.trace_log import TraceLog
from producer.tracing import Tracing


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
    tracing: Tracing | None = None  # spans of requests (GENQ_OTLP_TRACES_ENDPOINT; producer.tracing)
    trace: TraceLog | None = None  # the per-step trace's relay lines (GENQ_TRACE_DIR; producer.trace_log)
    managed_keys: ManagedKeys = field(init=False)  # the API keys kept in Redis (`genq keys`)
    webhooks: Webhooks = field(init=False)  # announces ended background responses and batches

    def __post_init__(self) -> None:
        object.__setattr__(self, "managed_keys", ManagedKeys(self.client.redis, self.client.keys))
        object.__setattr__(self, "webhooks", Webhooks(self.settings, self.client.redis, self.client.keys))


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


# The id of the API key the request came with (None: keys are off): the tenant its jobs are
# metered to. Set by `require_api_key`; tasks a request starts inherit it.
TENANT: ContextVar[str | None] = ContextVar("genq_tenant", default=None)
# The W3C traceparent of the request's span (main.RequestSpans; None: not traced): its jobs carry it.
TRACEPARENT: ContextVar[str | None] = ContextVar("genq_traceparent", default=None)


def key_id(key: str) -> str:
    """The name a key's usage is kept under: a digest, so Redis holds no secret."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


async def require_api_key(
    state: StateDep,
    authorization: Annotated[str | None, Header()] = None,
    x_api_key: Annotated[str | None, Header()] = None,
) -> None:
    """401 unless `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>`
    (Anthropic's) names a GENQ_API_KEYS key or a managed one (`genq keys`; none of either:
    open). Async so the tenant and plan it sets are the endpoint's (a sync dependency runs
    in a thread)."""
    static = state.settings.api_keys
    if not static and not await state.managed_keys.any():
        return
    scheme, _, key = (authorization or "").partition(" ")
    if authorization is None and x_api_key is not None:
        scheme, key = "bearer", x_api_key
    key = key.strip()
    matched = [k for k in static if secrets.compare_digest(key.encode(), k.encode())]
    plan = await state.managed_keys.plan(key) if scheme.lower() == "bearer" and key and not matched else None
    if scheme.lower() != "bearer" or not (matched or plan):
        raise APIError(
            401, "Incorrect API key provided: send `Authorization: Bearer <key>` or `x-api-key: <key>`.",
            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
        )
    TENANT.set(plan.name if plan else key_id(matched[0]))
    request_log.note(key=TENANT.get())
    PLAN.set(plan)
