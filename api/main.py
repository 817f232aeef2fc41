"""The FastAPI app: `create_app(settings)`; `uvicorn 'api.main:create_app' --factory` works too.

One app owns one genq `AsyncClient`, one relay (a single pub/sub connection shared by every
stream), one metrics registry and one batch runner (api.batches), created in its lifespan.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request, Response

from api.batch_runner import BatchRunner
from api.cluster import Cluster
from api.deps import AppState, require_api_key
from api.errors import install_error_handlers
from api.metrics import Metrics
from api.relay import Relay
from api.routes import (
    batches,
    chat,
    completions,
    embeddings,
    files,
    health,
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

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away: nobody reads it


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; `settings` defaults to the environment (GENQ_*)."""
    settings = settings if settings is not None else Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = AsyncClient(settings.redis_url, settings.prefix)
        relay = Relay(client.redis, client.keys)
        await relay.start()
        state = AppState(settings, client, relay, Cluster(client.redis, client.keys), Metrics())
        app.state.genq = state
        runner = asyncio.create_task(BatchRunner(state).run())
        try:
            yield
        finally:
            runner.cancel()
            for task in state.tasks:  # background responses: their jobs run on; a GET finishes them
                task.cancel()
            await asyncio.gather(runner, *state.tasks, return_exceptions=True)
            await relay.aclose()
            await client.aclose()

    app = FastAPI(title="genq", summary="LLM generation jobs over Redis", lifespan=lifespan)
    install_error_handlers(app)
    app.add_exception_handler(ClientDisconnected, _client_disconnected)
    guarded = [Depends(require_api_key)]
    for module in (completions, chat, embeddings, responses, messages, models, jobs, files, batches, usage):
        app.include_router(module.router, prefix="/v1", dependencies=guarded)
    app.include_router(tokenize.router, dependencies=guarded)  # vLLM serves these at the root
    app.include_router(scores.router, dependencies=guarded)  # at the root and under /v1, /v2
    if settings.allow_runtime_lora_updating:
        app.include_router(lora.router, prefix="/v1", dependencies=guarded)
    app.include_router(health.router)
    return app


async def _client_disconnected(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)
