"""The batch API (OpenAI's /v1/batches): a JSONL file of requests run as queue jobs at a lower
priority, their responses collected into an output file and an error file.

Creating a batch checks every line before any of it runs (a bad line fails the whole batch,
naming the line, as OpenAI's validation does) and stores the lines in Redis. From then on the
API processes drive it (`api.batch_runner`), keeping at most `GENQ_BATCH_MAX_IN_FLIGHT` of its
requests in the queue, so interactive requests are never stuck behind a whole batch.

Statuses, as OpenAI's: in_progress -> finalizing -> completed; failed (its file did not
validate); cancelling -> cancelled; expired (not done within the 24 h completion window).
Requests that fail, and those cancelled or expired before they ended, go to the error file.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from api import files
from api.api_keys import PLAN
from api.chat import chat_prompt, check_tool_parser, templated
from api.completions import reject_unsupported
from api.deps import TENANT, AppState
from api.embeddings import EmbeddingRenderer, encoded, plan_embeddings
from api.errors import APIError, not_found
from api.generate import GenerationRequest, Plan, plan
from api.messages_api import MessageRenderer, MessagesRequest, message_object, think_tags
from api.messages_api import to_chat as message_to_chat
from api.render import ChatRenderer, CompletionRenderer, Renderer
from api.request_bodies import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    PromptInput,
)
from api.responses_api import ResponseRenderer, ResponsesRequest, response_object, to_chat
from api.settings import Settings
from producer.redis_conn import ordered_writes

COMPLETION_WINDOW_S = {"24h": 24 * 3600}
BATCH_PRIORITY = 100  # added to each request's own: queued requests of the API go first
MAX_ERRORS = 100  # validation errors reported per batch
ACTIVE = ("in_progress", "cancelling")


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: dict[str, Any] | None = None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = RequestCounts()
    metadata: dict[str, str] | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    has_more: bool = False


class CreateBatch(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


def _as_is(request: Any, settings: Settings) -> Any:
    return request


def _responses(request: ResponsesRequest, settings: Settings) -> GenerationRequest:
    return to_chat(request)


def _messages(request: MessagesRequest, settings: Settings) -> GenerationRequest:
    return message_to_chat(request, think_tags(settings))


def _dumped(request: Any, response: BaseModel) -> dict[str, Any]:
    return response.model_dump(mode="json")


def _embeddings(request: EmbeddingRequest, response: dict[str, Any]) -> dict[str, Any]:
    return encoded(response, request.encoding_format)


@dataclass(frozen=True)
class Endpoint:
    """What a batch line's body is, what runs it, and how its response is written."""

    request: type[BaseModel]  # the body as the line gives it
    renderer: type[Renderer]
    to_run: Callable[[Any, Settings], GenerationRequest | EmbeddingRequest] = _as_is  # what runs it
    respond: Callable[[Any, Any], dict[str, Any]] = _dumped  # (request, rendered) -> body


ENDPOINTS = {
    "/v1/chat/completions": Endpoint(ChatCompletionRequest, ChatRenderer),
    "/v1/completions": Endpoint(CompletionRequest, CompletionRenderer),
    "/v1/responses": Endpoint(ResponsesRequest, ResponseRenderer, _responses, response_object),
    "/v1/embeddings": Endpoint(EmbeddingRequest, EmbeddingRenderer, respond=_embeddings),
    "/v1/messages": Endpoint(MessagesRequest, MessageRenderer, _messages, message_object),  # (api.message_batches)
}


# ---------------------------------------------------------------------------------------------
# Lines: one request each, {"custom_id", "method": "POST", "url", "body"}


@dataclass(frozen=True)
class Line:
    custom_id: str
    request: Any  # as the endpoint takes it
    body: GenerationRequest | EmbeddingRequest  # what runs it
    endpoint: Endpoint


def parse_line(text: str, endpoint: str, settings: Settings) -> Line:
    """One line of the input file; APIError naming what is wrong with it."""
    try:
        item = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(item, dict):
        raise APIError(400, "a line must be a JSON object", code="invalid_json")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise APIError(400, "custom_id must be a non-empty string", param="custom_id", code="missing_custom_id")
    if item.get("method") != "POST":
        raise APIError(400, "method must be POST", param="method", code="invalid_method")
    if item.get("url") != endpoint:
        raise APIError(400, f"url must be the batch's endpoint {endpoint}, got {item.get('url')!r}",
                       param="url", code="mismatched_url")
    kind = ENDPOINTS[endpoint]
    try:
        request = kind.request.model_validate(item.get("body"))
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or "body"
        raise APIError(400, f"body.{param}: {first['msg']}", param=f"body.{param}", code="invalid_body") from None
    if getattr(request, "stream", False):
        raise APIError(400, "a batch request does not stream", param="body.stream", code="invalid_body")
    return Line(custom_id, request, kind.to_run(request, settings), kind)


def plan_line(state: AppState, line: Line, batch_id: str, number: int,
              defaults: dict[str, Any] | None = None) -> Plan:
    """The jobs of one line: its ids from the batch's, a lower priority than API requests;
    `defaults`: the model's sampling values for fields the line leaves unset."""
    body = line.body
    base = f"{batch_id}-{number}"
    if isinstance(body, EmbeddingRequest):
        model = body.model or state.settings.served_model_name
        return plan_embeddings(body, base, model, body.model, priority_offset=BATCH_PRIORITY)
    prompts: list[PromptInput]
    if isinstance(body, ChatCompletionRequest):
        body = templated(body, state.settings)
        check_tool_parser(body, state.settings)
        prompts = [chat_prompt(body)]
    else:
        reject_unsupported(body, state.settings.max_prompt_embeds_bytes)
        prompts = body.prompts()
    renderer = line.endpoint.renderer()
    model = body.model or state.settings.served_model_name
    return plan(state, body, prompts, renderer, base, model, priority_offset=BATCH_PRIORITY, defaults=defaults)


# ---------------------------------------------------------------------------------------------
# Create, read, cancel


async def create(state: AppState, request: CreateBatch) -> BatchObject:
    if request.endpoint not in ENDPOINTS:
        raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got {request.endpoint!r}",
                       param="endpoint", code="invalid_endpoint")
    if request.completion_window not in COMPLETION_WINDOW_S:
        raise APIError(400, "completion_window must be 24h", param="completion_window", code="invalid_value")
    client = state.client
    meta = await files.read(client, request.input_file_id)
    if meta.purpose != "batch":
        raise APIError(400, f"file {meta.id} has purpose {meta.purpose!r}, not 'batch'",
                       param="input_file_id", code="invalid_file")
    text = (await files.content(client, request.input_file_id)).decode(errors="replace")
    lines = [line for line in text.splitlines() if line.strip()]
    batch_id = f"batch_{uuid.uuid4().hex}"
    return await store(state, request, lines, batch_id, await validate(state, lines, request.endpoint, batch_id))


async def validate(state: AppState, lines: list[str], endpoint: str, batch_id: str) -> list[dict[str, Any]]:
    """Every problem of the lines, up to MAX_ERRORS, each naming its line (1-based); off the
    event loop: checking a large file takes seconds that streams must not wait."""
    return await asyncio.to_thread(_validate, state, lines, endpoint, batch_id)


async def store(
    state: AppState, request: CreateBatch, lines: list[str], batch_id: str, errors: list[dict[str, Any]]
) -> BatchObject:
    """A batch of `lines` (the input file's), started; one with `errors` is stored as failed."""
    client = state.client
    now = int(time.time())
    batch = BatchObject(
        id=batch_id, endpoint=request.endpoint, input_file_id=request.input_file_id,
        completion_window=request.completion_window, created_at=now, metadata=request.metadata,
        request_counts=RequestCounts(total=len(lines)),
        status="failed" if errors else "in_progress",
        errors={"object": "list", "data": errors} if errors else None,
        failed_at=now if errors else None, in_progress_at=None if errors else now,
        expires_at=now + COMPLETION_WINDOW_S[request.completion_window],
    )
    keys, ttl = client.keys, state.settings.file_ttl_s
    pipe = ordered_writes(client.redis)
    tenant = TENANT.get()  # its lines are metered to the key that created it
    pipe.hset(keys.batch(batch_id), mapping={"object": batch.model_dump_json(), "next": 0,
                                             **({"tenant": tenant} if tenant else {})})
    pipe.expire(keys.batch(batch_id), ttl)
    pipe.zadd(keys.batches, {batch_id: now})
    if not errors:
        pipe.rpush(keys.batch_lines(batch_id), *lines)
        pipe.expire(keys.batch_lines(batch_id), ttl)
        pipe.sadd(keys.active_batches, batch_id)
    await pipe.execute()
    if errors:
        await state.webhooks.ended("batch", batch_id, "failed")
    return batch


def _validate(state: AppState, lines: list[str], endpoint: str, batch_id: str) -> list[dict[str, Any]]:
    """Every problem of the file, up to MAX_ERRORS, each naming its line (1-based)."""
    errors: list[dict[str, Any]] = []
    if not lines:
        errors.append({"code": "empty_file", "message": "the input file has no requests", "line": None, "param": None})
    seen: set[str] = set()
    for number, text in enumerate(lines):
        try:
            line = parse_line(text, endpoint, state.settings)
            if line.custom_id in seen:
                raise APIError(400, f"custom_id {line.custom_id!r} is not unique", param="custom_id",
                               code="duplicate_custom_id")
            seen.add(line.custom_id)
            _check_access(line, state.settings.served_model_name)
            plan_line(state, line, batch_id, number)
        except APIError as exc:
            errors.append({"code": exc.code, "message": exc.message, "param": exc.param, "line": number + 1})
            if len(errors) >= MAX_ERRORS:
                break
    return errors


def _check_access(line: Line, default_model: str) -> None:
    """A managed key's batch names only models the key may use (its lines run later, in the
    batch runner, with no key to check)."""
    plan, model = PLAN.get(), line.body.model or default_model
    if plan is not None and not plan.allows(model):
        raise APIError(404, f"The model `{model}` does not exist or this API key may not use it.",
                       param="body.model", code="model_not_found")


_FIELDS = ["object", "completed", "failed"]  # what a batch's hash holds for its object


async def read(state: AppState, batch_id: str) -> BatchObject:
    """The batch with its live request counts; 404 when there is none."""
    batch = _batch(await state.client.redis.hmget(state.client.keys.batch(batch_id), _FIELDS))
    if batch is None:
        raise not_found(f"No batch {batch_id!r} (never created, or expired).", "batch_not_found")
    return batch


def _batch(values: list[bytes | None]) -> BatchObject | None:
    """An HMGET of _FIELDS; None for a batch that is gone."""
    raw, completed, failed = values
    if raw is None:
        return None
    batch = BatchObject.model_validate_json(raw)
    batch.request_counts.completed, batch.request_counts.failed = int(completed or 0), int(failed or 0)
    return batch


async def listing(state: AppState, limit: int, after: str | None) -> BatchList:
    """The newest batches first, from just past `after`, in one round trip."""
    client = state.client
    ids = [i.decode() for i in await client.redis.zrevrange(client.keys.batches, 0, -1)]
    if after in ids:
        ids = ids[ids.index(after) + 1:]
    ids = ids[: limit + 1]
    pipe = client.redis.pipeline(transaction=False)
    for batch_id in ids:
        pipe.hmget(client.keys.batch(batch_id), _FIELDS)
    batches = [_batch(values) for values in await pipe.execute()]
    gone = [batch_id for batch_id, batch in zip(ids, batches, strict=True) if batch is None]
    if gone:  # expired: forget them (the page may come out short; `after` still pages on)
        await client.redis.zrem(client.keys.batches, *gone)
    found = [b for b in batches if b is not None]
    return BatchList(data=found[:limit], has_more=len(ids) > limit)


async def cancel(state: AppState, batch_id: str) -> BatchObject:
    """An active batch stops taking requests; its runner cancels those in the queue and ends
    it as cancelled once they have ended."""
    batch = await read(state, batch_id)
    if batch.status == "in_progress":
        batch.status, batch.cancelling_at = "cancelling", int(time.time())
        await save(state, batch)
    return batch


async def save(state: AppState, batch: BatchObject) -> None:
    await state.client.redis.hset(state.client.keys.batch(batch.id), "object", batch.model_dump_json())
