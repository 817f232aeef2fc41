"""Embeddings (`POST /v1/embeddings`, and batch lines of that endpoint): one embedding job per
input, planned, relayed and collected as generation is (api.generate), rendered as OpenAI's
list of vectors. Plain functions of plain data; no I/O."""

from __future__ import annotations

import base64
import time
from typing import Any

from api.errors import APIError, invalid_param
from api.generate import Plan, job_ids
from api.render import Choice, RelayedRequest
from api.request_bodies import EmbeddingRequest
from api.response_bodies import Usage
from producer.jobs import build_job
from producer.pooling_params import PoolingParams
from producer.protocol import Event, pack_embedding, unpack_embedding
from producer.sampling_params import SamplingParams


class EmbeddingRenderer:
    """OpenAI's embeddings response, as floats; `encoded` turns it into base64 when asked.
    It never streams."""

    object_name = "list"
    id_prefix = "embd-"

    def preamble(self, req: RelayedRequest) -> list[dict[str, Any]]:
        return []

    def chunk(self, req: RelayedRequest, choice: Choice, event: Event) -> dict[str, Any] | None:
        return None

    def response(self, req: RelayedRequest, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        missing = [c.index for c in choices if c.embedding is None]
        if missing:  # aborted (cancelled, past a deadline) before it was pooled
            raise APIError(500, f"input {missing[0]} ended without a vector ({choices[missing[0]].finish_reason})",
                           type="server_error", code="job_failed")
        data = [{"object": "embedding", "index": c.index, "embedding": unpack_embedding(c.embedding or b"")}
                for c in choices]
        return {"object": "list", "data": data, "model": req.model, "created": req.created,
                "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens}}


def plan_embeddings(
    body: EmbeddingRequest, base: str, model: str, job_model: str | None, priority_offset: int = 0
) -> Plan:
    """Check a request and build its embedding jobs (ids from `base`) without submitting any;
    APIError naming what is wrong."""
    if body.messages is not None and body.input is not None:
        raise invalid_param("messages", "give input or messages, not both")
    prompts = body.inputs()
    if not prompts or any(p in ("", {"prompt_token_ids": []}) for p in prompts):
        raise invalid_param("input", "input must be a non-empty string or token list, or a list of them")
    ids = job_ids(base, len(prompts))
    try:
        pooling = PoolingParams(normalize=body.normalize, truncate_prompt_tokens=body.truncate_prompt_tokens,
                                dimensions=body.dimensions)
    except ValueError as exc:
        raise invalid_param("dimensions" if str(exc).startswith("dimensions") else "truncate_prompt_tokens",
                            str(exc)) from exc
    priority = body.priority + priority_offset
    try:  # every job checked before any is queued
        for prompt, job_id in zip(prompts, ids, strict=True):
            build_job(prompt, priority=priority, job_id=job_id, model=job_model, pooling_params=pooling)
    except ValueError as exc:
        raise invalid_param("messages" if body.messages is not None else "input", str(exc)) from exc
    req = RelayedRequest(id=EmbeddingRenderer.id_prefix + base, job_ids=ids, n=1, model=model, created=int(time.time()))
    return Plan(req, prompts, SamplingParams(), priority, job_model, None, pooling_params=pooling)


def encoded(response: dict[str, Any], encoding_format: str) -> dict[str, Any]:
    """The response with each vector as OpenAI's `encoding_format` asks: floats, or base64 of
    the float32 little-endian bytes (the floats are float32 values: packing is exact)."""
    if encoding_format != "base64":
        return response
    data = [{**item, "embedding": base64.b64encode(pack_embedding(item["embedding"])).decode()}
            for item in response["data"]]
    return {**response, "data": data}
