"""The FastAPI app: `create_app(settings)`; `uvicorn 'api.main:create_app' --factory` works too.

One app owns one genq `AsyncClient`, one relay (a single pub/sub connection shared by every
stream), one metrics registry and one batch runner (api.batches), created in its lifespan.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import ModuleType
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import openapi
from api.batch_runner import BatchRunner
from api.body_limit import BodyLimit
from api.cluster import Cluster
from api.deps import TRACEPARENT, AppState, require_api_key
from api.errors import install_error_handlers
from api.metrics import Metrics
from api.relay import Relay
from api.request_log import REQUEST_ID_SCOPE_KEY, RequestLog
from api.routes import (
    audio,
    batches,
    chat,
    completions,
    conversations,
    dev,
    embeddings,
    files,
    health,
    invocations,
    jobs,
    lora,
    messages,
    models,
    responses,
    scores,
    tokenize,
    usage,
)
from api.settings import Settings
from api.sse import ClientDisconnected
from producer.async_client import AsyncClient
from producer.trace_log import open_trace
from producer.tracing import Tracing

UNTRACED = frozenset({"/health", "/metrics", "/ping", "/version"})  # probes and scrapes: no spans, no log lines
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away: nobody reads it


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; `settings` defaults to the environment (GENQ_*)."""
    settings = settings if settings is not None else Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = AsyncClient(settings.redis_url, settings.prefix, settings.redis_shards)
        relay = Relay(client.redis, client.keys, client.events_redis)
        await relay.start()
        tracing = Tracing(settings.otlp_traces_endpoint, "genq-api") if settings.otlp_traces_endpoint else None
        trace = open_trace(settings.trace_dir, "api")
        state = AppState(settings, client, relay, Cluster(client.redis, client.keys, client.pubsub_redis), Metrics(),
                         tracing=tracing, trace=trace)
        app.state.genq = state
        runner = asyncio.create_task(BatchRunner(state).run())
        sender = asyncio.create_task(state.webhooks.run())
        try:
            yield
        finally:
            runner.cancel()
            sender.cancel()
            for task in state.tasks:  # background responses: their jobs run on; a GET finishes them
                task.cancel()
            await asyncio.gather(runner, sender, *state.tasks, return_exceptions=True)
            await relay.aclose()
            await client.aclose()
            if trace is not None:
                trace.close()
            if tracing is not None:
                await asyncio.to_thread(tracing.shutdown)  # the last requests' spans go out

    app = FastAPI(title="genq", summary="LLM generation jobs over Redis", lifespan=lifespan)
    install_error_handlers(app)
    app.add_exception_handler(ClientDisconnected, _client_disconnected)
    guarded = [Depends(require_api_key)]
    for module in (completions, chat, embeddings, responses, conversations, messages, models, jobs, files, batches,
                   usage, audio):
        app.include_router(module.router, prefix="/v1", dependencies=guarded, responses=_errors_of(module))
    app.include_router(tokenize.router, dependencies=guarded, responses=openapi.GUARDED)  # vLLM serves these at the root
    # at the root and under /v1, /v2
    app.include_router(scores.router, dependencies=guarded, responses=openapi.GENERATES)
    app.include_router(invocations.router, dependencies=guarded, responses=openapi.GENERATES)
    app.include_router(embeddings.pooling_router, dependencies=guarded, responses=openapi.GENERATES)
    if settings.allow_runtime_lora_updating:
        app.include_router(lora.router, prefix="/v1", dependencies=guarded, responses=openapi.GUARDED)
    if settings.server_dev_mode:
        app.include_router(dev.router, dependencies=guarded, responses=openapi.GUARDED)
    app.include_router(health.router, responses=openapi.HEALTH)
    openapi.install(app)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    if settings.log_requests:  # (inside RequestIdHeader: it reads the id that one leaves)
        app.add_middleware(RequestLog, skipped=UNTRACED)
    app.add_middleware(BodyLimit, limit_bytes=settings.max_request_bytes)
    app.add_middleware(RequestIdHeader)
    if settings.otlp_traces_endpoint:
        app.add_middleware(RequestSpans)
    return app


def _errors_of(module: ModuleType) -> dict[int | str, dict[str, Any]]:
    """The error responses a /v1 router's operations may give (api.openapi)."""
    if module is messages:
        return openapi.ANTHROPIC
    if module is batches:
        return openapi.SUBMITS
    return openapi.GENERATES if module in (completions, chat, embeddings, responses, jobs, audio) else openapi.GUARDED


class RequestIdHeader:
    """Every response carries `X-Request-Id`: the request's own, or a new one (vLLM's
    --enable-request-id-headers), so a client can name a request in a report. Plain ASGI:
    streamed responses pass through as they are."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id")
        request_id = given if given and len(given) <= 128 else uuid.uuid4().hex.encode()
        scope[REQUEST_ID_SCOPE_KEY] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id)]
            await send(message)

        await self.app(scope, receive, send_with_id)


class RequestSpans:
    """With GENQ_OTLP_TRACES_ENDPOINT, a span per request (producer.tracing), a child of the
    client's `traceparent` header when it sends one; its own traceparent goes to the request's
    jobs (deps.TRACEPARENT). Plain ASGI: a streamed response's span ends with its stream."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = getattr(scope["app"].state, "genq", None) if scope["type"] == "http" else None
        tracing = state.tracing if state is not None else None
        if tracing is None or scope["path"] in UNTRACED:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"traceparent", b"").decode(errors="replace")
        span = tracing.tracer.start_span(f"{scope['method']} {scope['path']}", context=tracing.parent(given or None))
        status = 500

        async def send_seen(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        token = TRACEPARENT.set(tracing.traceparent(span))
        try:
            await self.app(scope, receive, send_seen)
        finally:
            TRACEPARENT.reset(token)
            span.set_attributes({"http.request.method": scope["method"], "url.path": scope["path"],
                                 "http.response.status_code": status})
            span.end()


async def _client_disconnected(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)
