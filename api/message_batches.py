"""Anthropic's Message Batches API (`/v1/messages/batches`) over genq's batches (api.batches):
a batch of Messages requests is stored as an input file of `/v1/messages` lines and run by the
batch runner as any batch is; this module shows it as Anthropic shows a message batch, and its
results as Anthropic's JSONL (one `{"custom_id", "result"}` per request: succeeded with the
message, errored with the error, canceled or expired for those that never ended).

Requests are checked when the batch is made: one that does not check out is a 400 naming it
(`requests.N.params...`). A batch is `in_progress`, `canceling`, then `ended`.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel

from api import batches, files
from api.deps import AppState
from api.errors import invalid_param, not_found
from producer.redis_conn import ordered_writes

ENDPOINT = "/v1/messages"
PREFIX = "msgbatch_"
ENDED = ("completed", "failed", "cancelled", "expired")


class Request(BaseModel):
    custom_id: str
    params: dict[str, Any]


class CreateMessageBatch(BaseModel):
    requests: list[Request]


async def create(state: AppState, body: CreateMessageBatch) -> dict[str, Any]:
    if not body.requests:
        raise invalid_param("requests", "requests must be a non-empty list")
    lines = [json.dumps({"custom_id": r.custom_id, "method": "POST", "url": ENDPOINT, "body": r.params})
             for r in body.requests]
    batch_id = PREFIX + uuid.uuid4().hex
    errors = await batches.validate(state, lines, ENDPOINT, batch_id)
    if errors:  # refused before anything is stored, naming the request
        first = errors[0]
        where = f"requests.{first['line'] - 1}"
        param = (first["param"] or "").replace("body", "params", 1)
        raise invalid_param(f"{where}.{param}" if param else where, first["message"].replace("body.", "params.", 1))
    stored = await files.store(state.client, ("\n".join(lines) + "\n").encode(), f"{batch_id}_input.jsonl", "batch",
                               state.settings.file_ttl_s)
    request = batches.CreateBatch(input_file_id=stored.id, endpoint=ENDPOINT)
    return view(await batches.store(state, request, lines, batch_id, []))


async def read(state: AppState, batch_id: str) -> batches.BatchObject:
    """A message batch (a batch of /v1/messages lines); 404 for any other id."""
    batch = await batches.read(state, batch_id) if batch_id.startswith(PREFIX) else None
    if batch is None or batch.endpoint != ENDPOINT:
        raise not_found(f"No message batch {batch_id!r} (never created, or expired).", "not_found")
    return batch


async def shown(state: AppState, batch: batches.BatchObject, base_url: str) -> dict[str, Any]:
    """`view` with the batch's requests that were stopped (cancelled or expired) while they ran,
    which the runner counts among the failed."""
    stopped = await state.client.redis.hget(state.client.keys.batch(batch.id), "stopped")
    return view(batch, base_url, int(stopped or 0))


def view(batch: batches.BatchObject, base_url: str = "", stopped: int = 0) -> dict[str, Any]:
    """The batch as Anthropic shows a message batch; `stopped`: of its failed requests, those
    cancelled or expired while they ran (canceled or expired, not errored)."""
    counts = batch.request_counts
    ended = batch.status in ENDED
    remaining = counts.total - counts.completed - counts.failed  # not yet run, or (ended) never run
    unrun = (remaining if ended else 0) + stopped
    end_time = batch.completed_at or batch.cancelled_at or batch.expired_at or batch.failed_at
    return {
        "id": batch.id, "type": "message_batch",
        "processing_status": "ended" if ended else "canceling" if batch.status == "cancelling" else "in_progress",
        "request_counts": {
            "processing": 0 if ended else remaining, "succeeded": counts.completed, "errored": counts.failed - stopped,
            "canceled": unrun if batch.status in ("cancelled", "cancelling") else 0,
            "expired": unrun if batch.status == "expired" else 0,
        },
        "created_at": _time(batch.created_at), "expires_at": _time(batch.expires_at),
        "ended_at": _time(end_time) if ended else None,
        "cancel_initiated_at": _time(batch.cancelling_at), "archived_at": None,
        "results_url": f"{base_url}/v1/messages/batches/{batch.id}/results" if ended else None,
    }


def _time(seconds: int | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")


async def listing(state: AppState, limit: int, after_id: str | None, base_url: str) -> dict[str, Any]:
    """The newest message batches first, from just past `after_id`."""
    found: list[batches.BatchObject] = []
    after: str | None = after_id
    while len(found) <= limit:  # other batches may stand between them
        page = await batches.listing(state, 100, after)
        found += [b for b in page.data if b.endpoint == ENDPOINT]
        if not (page.has_more and page.data):
            break
        after = page.data[-1].id
    data = [await shown(state, b, base_url) for b in found[:limit]]
    return {"data": data, "has_more": len(found) > limit,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


async def results(state: AppState, batch: batches.BatchObject) -> str:
    """Anthropic's JSONL results of an ended batch, in the requests' order."""
    if batch.status not in ENDED:
        raise invalid_param("message_batch_id", f"batch {batch.id} has not ended: its results are not ready")
    by_id: dict[str, dict[str, Any]] = {}
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id is not None:
            for text in (await files.content(state.client, file_id)).decode().splitlines():
                line = json.loads(text)
                by_id[line["custom_id"]] = _result(line)
    order = [json.loads(text)["custom_id"]
             for text in (await files.content(state.client, batch.input_file_id)).decode().splitlines() if text]
    never = {"type": "expired" if batch.status == "expired" else "canceled"}
    return "".join(json.dumps({"custom_id": c, "result": by_id.get(c, never)}) + "\n" for c in order)


def _result(line: dict[str, Any]) -> dict[str, Any]:
    """One output or error line (OpenAI's batch form) as Anthropic's result."""
    response = line.get("response") or {}
    if response.get("status_code") == 200:
        return {"type": "succeeded", "message": response["body"]}
    if response:
        error = (response.get("body") or {}).get("error") or {}
        status = response.get("status_code", 500)
        kind = "invalid_request_error" if 400 <= status < 500 else "api_error"
        return {"type": "errored", "error": {"type": "error", "error": {"type": kind, "message": error.get("message", "")}}}
    code = (line.get("error") or {}).get("code")
    return {"type": "expired" if code == "batch_expired" else "canceled"}


async def delete(state: AppState, batch: batches.BatchObject) -> dict[str, Any]:
    """Forget an ended batch (its files expire as files do); a running one must be canceled first."""
    if batch.status not in ENDED:
        raise invalid_param("message_batch_id", f"batch {batch.id} is still running: cancel it before deleting it")
    keys = state.client.keys
    pipe = ordered_writes(state.client.redis)
    pipe.delete(keys.batch(batch.id))
    pipe.zrem(keys.batches, batch.id)
    await pipe.execute()
    return {"id": batch.id, "type": "message_batch_deleted"}
