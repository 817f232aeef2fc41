"""Background responses (the Responses API's `background: true`): the request returns at once
with a `queued` response, its job runs through the queue like any other, and the client polls
`GET /v1/responses/{id}` (or cancels with `POST /v1/responses/{id}/cancel`).

The stored record holds what finishing needs: the request, the chat request it became, and
how its job is relayed. The API process that took the request finishes it in a task; any API
process that is asked for it finishes it too once its job has ended (the job's events stay in
Redis), so a restarted or different API process loses nothing. Finishing writes the ordinary
stored response over the record; two processes finishing at once write the same thing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncGenerator
from typing import Any

from api import generate, request_log, responses_api, stored_responses
from api.conversations import request_items
from api.deps import AppState
from api.errors import APIError
from api.render import RelayedRequest
from api.request_bodies import ChatCompletionRequest
from api.responses_api import ResponseRenderer, ResponsesRequest, envelope, finish
from producer.jobs import JobNotFound
from producer.protocol import FINISH_ABORT, JobStatus

log = logging.getLogger(__name__)

# a job's status as the status of a response still running
_RUNNING = {JobStatus.QUEUED: "queued", JobStatus.RUNNING: "in_progress"}
ENDED = ("completed", "incomplete", "failed", "cancelled")  # a response's final statuses


async def start(
    state: AppState, body: ResponsesRequest, chat: ChatCompletionRequest, req: RelayedRequest
) -> dict[str, Any]:
    """Store the queued response with what finishing needs, start finishing it here, and
    return its record (`response`: as it stands; `background`: what finishing needs)."""
    shell = _shell(body, req, "queued")
    record = {"response": shell, "background": {
        "request": body.model_dump(), "chat": chat.model_dump(exclude_none=True), "relayed": dataclasses.asdict(req),
    }}
    await _store(state, shell["id"], record)
    request_log.note(response_id=shell["id"], model=req.model, jobs=list(req.job_ids))  # (its end: a line of its own)
    task = asyncio.create_task(_finish_when_done(state, record), name=f"genq-background-{shell['id']}")
    state.tasks.add(task)
    task.add_done_callback(state.tasks.discard)
    return record


def replay(state: AppState, stored: dict[str, Any], starting_after: int = -1) -> AsyncGenerator[str, None]:
    """A background response's event stream, from the job's events in Redis: the whole of
    it, or what follows event `starting_after` (a client that lost its connection)."""
    if "background" not in stored:
        raise APIError(400, "Only a background response can be streamed again.", param="stream")
    body, chat = _requests(stored)
    return responses_api.stream(state, body, _relayed(stored), chat, starting_after, stored["background"])


async def current(state: AppState, stored: dict[str, Any]) -> dict[str, Any]:
    """A stored response as it stands: a background one is finished here if its job ended,
    else shown queued or in progress."""
    if "background" not in stored or stored.get("done"):
        response: dict[str, Any] = stored["response"]
        return response
    req = _relayed(stored)
    statuses = [await _status(state, job_id) for job_id in req.job_ids]
    if all(s is not None and s.terminal for s in statuses):
        return await _finish(state, stored)
    running = "in_progress" if JobStatus.RUNNING in statuses else "queued"
    return {**stored["response"], "status": running}


def input_items(stored: dict[str, Any]) -> list[dict[str, Any]]:
    """A stored response's input as items: kept with it once it ended, else its request's."""
    if "input_items" in stored:
        items: list[dict[str, Any]] = stored["input_items"]
        return items
    return request_items(_requests(stored)[0].input) if "background" in stored else []


async def cancel(state: AppState, stored: dict[str, Any]) -> dict[str, Any]:
    """Cancel a background response's job: it is `cancelled` from now on (a job that ended
    first keeps its result). 400 for a response that was not in the background."""
    if "background" not in stored:
        raise APIError(400, "Only a background response can be cancelled.", param="response_id")
    if stored.get("done"):
        return dict(stored["response"])  # it ended already: as it ended
    req = _relayed(stored)
    statuses = [await _status(state, job_id) for job_id in req.job_ids]
    if all(s is not None and s.terminal for s in statuses):
        return await _finish(state, stored)
    for job_id in req.job_ids:
        await state.client.cancel(job_id)
    # Not waiting for a worker to see the cancel: with none live, nothing would answer.
    final = await _save_ended(state, stored, "cancelled")
    await state.webhooks.ended("response", final["id"], "cancelled")
    return final


async def _finish_when_done(state: AppState, record: dict[str, Any]) -> None:
    try:
        await request_log.background_line(_finish(state, record))
    except asyncio.CancelledError:
        raise  # shutdown: the job runs on; a later GET finishes the response
    except Exception:  # noqa: BLE001 (logged; a later GET finishes it)
        log.exception("finishing background response %s", record["response"]["id"])


async def _finish(state: AppState, record: dict[str, Any]) -> dict[str, Any]:
    """Wait for the job's end (replayed from Redis if it is over), store the result and
    announce it (api.webhooks)."""
    final = await _finished(state, record)
    if final["status"] in ENDED:
        await state.webhooks.ended("response", final["id"], final["status"])
    return final


async def _finished(state: AppState, record: dict[str, Any]) -> dict[str, Any]:
    req = _relayed(record)
    try:
        response = await generate.collect(state, req, ResponseRenderer(), keep_jobs=True)
    except APIError as exc:
        if exc.code == "timeout":  # queued longer than a request may wait: a later GET finishes it
            return dict(record["response"])
        statuses = [await _status(state, job_id) for job_id in req.job_ids]
        if all(s == JobStatus.CANCELLED for s in statuses):
            return await _save_ended(state, record, "cancelled")
        return await _save_ended(state, record, "failed", {"code": exc.code, "message": exc.message})
    if response.choices[0].finish_reason == FINISH_ABORT:
        return await _save_ended(state, record, "cancelled")
    body, chat = _requests(record)
    return await finish(state, body, chat, response, record["background"])


async def _save_ended(
    state: AppState, record: dict[str, Any], status: str, error: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Store a response that ended without output (cancelled, failed) as its final form."""
    body, chat = _requests(record)
    final = {**_shell(body, _relayed(record), status), "error": error}
    await stored_responses.save(state, final, chat, instructions=bool(body.instructions),
                                input_items=request_items(body.input), background=record["background"])
    return final


def _requests(record: dict[str, Any]) -> tuple[ResponsesRequest, ChatCompletionRequest]:
    background = record["background"]
    return ResponsesRequest.model_validate(background["request"]), ChatCompletionRequest.model_validate(background["chat"])


def _shell(body: ResponsesRequest, req: RelayedRequest, status: str) -> dict[str, Any]:
    return {**envelope(body, req.id, req.created, req.model, req.service_tier), "status": status, "background": True,
            "output": [], "incomplete_details": None, "usage": None}


def _relayed(record: dict[str, Any]) -> RelayedRequest:
    fields = dict(record["background"]["relayed"])
    fields["echo"] = tuple(fields.get("echo") or ())
    fields["string_parameters"] = tuple(tuple(pair) for pair in fields.get("string_parameters") or ())
    return RelayedRequest(**fields)


async def _status(state: AppState, job_id: str) -> JobStatus | None:
    """None when the job's record is gone (expired)."""
    try:
        return await state.client.status(job_id)
    except JobNotFound:
        return None


async def _store(state: AppState, response_id: str, record: dict[str, Any]) -> None:
    key = state.client.keys.stored_response(response_id)
    await state.client.redis.set(key, json.dumps(record), ex=state.settings.file_ttl_s)
