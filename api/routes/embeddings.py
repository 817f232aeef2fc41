"""`POST /v1/embeddings`: one embedding job per input (queued, routed and run like any job),
answered once every vector is back."""

from __future__ import annotations

import base64
import time
import uuid
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request

from api import generate
from api.deps import AppState, StateDep
from api.errors import APIError, invalid_param
from api.schemas import EmbeddingRequest
from api.sse import unless_disconnected
from producer.jobs import build_job
from producer.pooling_params import PoolingParams
from producer.protocol import ERROR_INVALID_REQUEST, unpack_embedding

router = APIRouter(tags=["openai"])


@router.post("/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request, state: StateDep) -> dict[str, Any]:
    prompts = body.inputs()
    if not prompts or any(p in ("", {"prompt_token_ids": []}) for p in prompts):
        raise invalid_param("input", "input must be a non-empty string or token list, or a list of them")
    if body.dimensions is not None:
        raise invalid_param("dimensions", "dimensions is not supported: this model's vectors have one size")
    model = await generate.resolve_model(state, body.model)
    await generate.check_backpressure(state)
    job_model = await generate.job_model(state, body.model, model)
    ids = generate.job_ids(uuid.uuid4().hex, len(prompts))
    pooling = PoolingParams(normalize=body.normalize)
    try:  # every job checked before any is queued
        for prompt, job_id in zip(prompts, ids, strict=True):
            build_job(prompt, priority=body.priority, job_id=job_id, model=job_model, pooling_params=pooling)
    except ValueError as exc:
        raise invalid_param("input", str(exc)) from exc
    for prompt, job_id in zip(prompts, ids, strict=True):
        await state.client.submit(prompt, priority=body.priority, job_id=job_id, model=job_model,
                                  pooling_params=pooling)
    vectors, prompt_tokens = await unless_disconnected(request, _collect(state, ids))
    data = [{"object": "embedding", "index": i, "embedding": _encoded(vectors[job_id], body.encoding_format)}
            for i, job_id in enumerate(ids)]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage, "created": int(time.time())}


async def _collect(state: AppState, job_ids: list[str]) -> tuple[dict[str, bytes], int]:
    """Each job's vector (float32 bytes) and the prompt tokens of all; the jobs are cancelled
    if this stops early (a disconnect, a timeout, a failed sibling)."""
    vectors: dict[str, bytes] = {}
    prompt_tokens = 0
    ended = False
    try:
        follow = state.relay.follow(job_ids, timeout_s=state.settings.request_timeout_s)
        async with aclosing(follow) as events:
            async for job_id, event in events:
                if event.error is not None:
                    status = 400 if event.error_type == ERROR_INVALID_REQUEST else 500
                    code = "invalid_request" if status == 400 else "job_failed"
                    raise APIError(status, event.error, type="invalid_request_error" if status == 400 else "server_error",
                                   code=code)
                if event.finished and event.embedding is None:
                    raise APIError(500, f"job {job_id} ended without a vector ({event.finish_reason})",
                                   type="server_error", code="job_failed")
                if event.finished:
                    vectors[job_id] = event.embedding or b""
                    prompt_tokens += (event.usage or {}).get("prompt_tokens", 0)
        ended = True
    except TimeoutError as exc:
        raise APIError(504, str(exc), type="timeout_error", code="timeout") from exc
    finally:
        if not ended:
            await generate.cancel_jobs(state, job_ids)
    return vectors, prompt_tokens


def _encoded(vector: bytes, encoding_format: str) -> list[float] | str:
    """OpenAI's forms: floats, or base64 of the float32 little-endian bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector).decode()
    return unpack_embedding(vector)
