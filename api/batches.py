"""The batch API (OpenAI's /v1/batches): a JSONL file of requests run as queue jobs at a lower
priority, their responses collected into an output file and an error file.

Creating a batch checks every line before any of it runs (a bad line fails the whole batch,
naming the line, as OpenAI's validation does) and stores the lines in Redis. From then on the
API processes drive it: each runs a `BatchRunner` that, for the batches whose lease it holds,
keeps at most `GENQ_BATCH_MAX_IN_FLIGHT` of their requests in the queue, so interactive
requests are never stuck behind a whole batch, and collects each request once its jobs end.
Everything a batch needs is in Redis, so when an API process dies another one takes its
batches over once their lease lapses. Each result is written with HSETNX, so a request is
counted once even if two processes collect it.

Statuses, as OpenAI's: in_progress -> finalizing -> completed; failed (its file did not
validate); cancelling -> cancelled; expired (not done within the 24 h completion window).
Requests that fail, and those cancelled or expired before they ended, go to the error file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import redis
from pydantic import BaseModel, ValidationError

from api import files
from api.deps import AppState
from api.errors import APIError, not_found
from api.generate import Collector, GenerationRequest, Plan, job_ids, plan, submit
from api.render import ChatRenderer, CompletionRenderer, Renderer
from api.routes.chat import chat_prompt, check_tool_parser
from api.routes.completions import reject_unsupported
from api.schemas import ChatCompletionRequest, CompletionRequest, PromptInput
from producer.protocol import JobStatus

log = logging.getLogger("api.batches")

COMPLETION_WINDOW_S = {"24h": 24 * 3600}
BATCH_PRIORITY = 100  # added to each request's own: queued requests of the API go first
LEASE_TTL_S = 10.0  # an API process that stops renewing loses its batches after this
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


@dataclass(frozen=True)
class Endpoint:
    body: type[GenerationRequest]
    renderer: type[Renderer]


ENDPOINTS = {
    "/v1/chat/completions": Endpoint(ChatCompletionRequest, ChatRenderer),
    "/v1/completions": Endpoint(CompletionRequest, CompletionRenderer),
}


# ---------------------------------------------------------------------------------------------
# Lines: one request each, {"custom_id", "method": "POST", "url", "body"}


@dataclass(frozen=True)
class Line:
    custom_id: str
    body: GenerationRequest


def parse_line(text: str, endpoint: str) -> Line:
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
    try:
        body = ENDPOINTS[endpoint].body.model_validate(item.get("body"))
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or "body"
        raise APIError(400, f"body.{param}: {first['msg']}", param=f"body.{param}", code="invalid_body") from None
    if body.stream:
        raise APIError(400, "a batch request does not stream", param="body.stream", code="invalid_body")
    return Line(custom_id, body)


def plan_line(state: AppState, line: Line, batch_id: str, number: int) -> Plan:
    """The jobs of one line: its ids from the batch's, a lower priority than API requests."""
    body = line.body
    prompts: list[PromptInput]
    renderer: Renderer
    if isinstance(body, ChatCompletionRequest):
        check_tool_parser(body, state.settings)
        prompts, renderer = [chat_prompt(body)], ChatRenderer()
    else:
        reject_unsupported(body)
        prompts, renderer = body.prompts(), CompletionRenderer()
    model = body.model or state.settings.served_model_name
    return plan(state, body, prompts, renderer, f"{batch_id}-{number}", model, priority_offset=BATCH_PRIORITY)


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
    # off the event loop: checking a large file takes seconds that streams must not wait
    errors = await asyncio.to_thread(_validate, state, lines, request.endpoint, batch_id)
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
    pipe = client.redis.pipeline(transaction=True)
    pipe.hset(keys.batch(batch_id), mapping={"object": batch.model_dump_json(), "next": 0})
    pipe.expire(keys.batch(batch_id), ttl)
    pipe.zadd(keys.batches, {batch_id: now})
    if not errors:
        pipe.rpush(keys.batch_lines(batch_id), *lines)
        pipe.expire(keys.batch_lines(batch_id), ttl)
        pipe.sadd(keys.active_batches, batch_id)
    await pipe.execute()
    return batch


def _validate(state: AppState, lines: list[str], endpoint: str, batch_id: str) -> list[dict[str, Any]]:
    """Every problem of the file, up to MAX_ERRORS, each naming its line (1-based)."""
    errors: list[dict[str, Any]] = []
    if not lines:
        errors.append({"code": "empty_file", "message": "the input file has no requests", "line": None, "param": None})
    seen: set[str] = set()
    for number, text in enumerate(lines):
        try:
            line = parse_line(text, endpoint)
            if line.custom_id in seen:
                raise APIError(400, f"custom_id {line.custom_id!r} is not unique", param="custom_id",
                               code="duplicate_custom_id")
            seen.add(line.custom_id)
            plan_line(state, line, batch_id, number)
        except APIError as exc:
            errors.append({"code": exc.code, "message": exc.message, "param": exc.param, "line": number + 1})
            if len(errors) >= MAX_ERRORS:
                break
    return errors


async def read(state: AppState, batch_id: str) -> BatchObject:
    """The batch with its live request counts; 404 when there is none."""
    raw, completed, failed = await state.client.redis.hmget(
        state.client.keys.batch(batch_id), ["object", "completed", "failed"]
    )
    if raw is None:
        raise not_found(f"No batch {batch_id!r} (never created, or expired).", "batch_not_found")
    batch = BatchObject.model_validate_json(raw)
    batch.request_counts.completed, batch.request_counts.failed = int(completed or 0), int(failed or 0)
    return batch


async def listing(state: AppState, limit: int, after: str | None) -> BatchList:
    """The newest batches first, from just past `after`."""
    ids = [i.decode() for i in await state.client.redis.zrevrange(state.client.keys.batches, 0, -1)]
    if after in ids:
        ids = ids[ids.index(after) + 1:]
    found: list[BatchObject] = []
    for batch_id in ids:
        try:
            found.append(await read(state, batch_id))
        except APIError:  # expired
            await state.client.redis.zrem(state.client.keys.batches, batch_id)
        if len(found) > limit:
            break
    return BatchList(data=found[:limit], has_more=len(found) > limit)


async def cancel(state: AppState, batch_id: str) -> BatchObject:
    """An active batch stops taking requests; its runner cancels those in the queue and ends
    it as cancelled once they have ended."""
    batch = await read(state, batch_id)
    if batch.status == "in_progress":
        batch.status, batch.cancelling_at = "cancelling", int(time.time())
        await _save(state, batch)
    return batch


async def _save(state: AppState, batch: BatchObject) -> None:
    await state.client.redis.hset(state.client.keys.batch(batch.id), "object", batch.model_dump_json())


# ---------------------------------------------------------------------------------------------
# Running


class BatchRunner:
    """Drives the batches whose lease this API process holds (see the module docstring)."""

    def __init__(self, state: AppState) -> None:
        self.state = state
        self.name = uuid.uuid4().hex  # this process, as lease holder
        self.leased: set[str] = set()

    async def run(self) -> None:
        """Until cancelled (the app stops); then the leases go back, for another API process
        to take over at once."""
        try:
            while True:
                try:
                    await self.tick()
                except (redis.RedisError, OSError) as exc:
                    log.warning("batch runner: Redis unavailable (%s); retrying", exc)
                except Exception:  # noqa: BLE001 - a bug in one batch must not stop the others
                    log.exception("batch runner: tick failed")
                await asyncio.sleep(self.state.settings.batch_poll_s)
        finally:
            await asyncio.shield(self._release())

    async def _release(self) -> None:
        keys, redis_ = self.state.client.keys, self.state.client.redis
        for batch_id in self.leased:
            try:
                if await redis_.get(keys.batch_lease(batch_id)) == self.name.encode():
                    await redis_.delete(keys.batch_lease(batch_id))
            except redis.RedisError:
                return  # they lapse by themselves

    async def tick(self) -> None:
        keys = self.state.client.keys
        for raw in await self.state.client.redis.smembers(keys.active_batches):
            batch_id = raw.decode()
            if await self._lease(batch_id):
                await self.advance(batch_id)

    async def _lease(self, batch_id: str) -> bool:
        """Take the batch's lease, or renew it if it is ours."""
        key, ttl_ms = self.state.client.keys.batch_lease(batch_id), int(LEASE_TTL_S * 1000)
        redis_ = self.state.client.redis
        if await redis_.set(key, self.name, nx=True, px=ttl_ms):
            self.leased.add(batch_id)
            return True
        if await redis_.get(key) == self.name.encode():
            await redis_.pexpire(key, ttl_ms)
            return True
        self.leased.discard(batch_id)
        return False

    async def advance(self, batch_id: str) -> None:
        """Collect what ended, submit more (or cancel what runs, when stopping), finish."""
        keys, redis_ = self.state.client.keys, self.state.client.redis
        batch = await read(self.state, batch_id)
        if batch.status not in ACTIVE:
            await redis_.srem(keys.active_batches, batch_id)
            return
        in_flight = {m.decode() for m in await redis_.smembers(keys.batch_in_flight(batch_id))}
        next_line = int(await redis_.hget(keys.batch(batch_id), "next") or 0)
        await self._collect(batch, in_flight)
        stopping = batch.status == "cancelling" or time.time() > (batch.expires_at or 0)
        if stopping:
            await self._cancel_jobs(batch_id, in_flight)
        else:
            next_line = await self._submit_more(batch, in_flight, next_line)
        if not in_flight and (stopping or next_line >= batch.request_counts.total):
            await self._finish(batch, next_line)

    async def _submit_more(self, batch: BatchObject, in_flight: set[str], next_line: int) -> int:
        """Lines in order from `next_line`, until `batch_max_in_flight` are in the queue;
        returns the next line then. Each is marked in flight before it is submitted, so a
        process that dies in between leaves a line that `_collect` submits again (submitting
        is idempotent), never one that is lost."""
        keys, redis_ = self.state.client.keys, self.state.client.redis
        room = self.state.settings.batch_max_in_flight - len(in_flight)
        texts = await redis_.lrange(keys.batch_lines(batch.id), next_line, next_line + room - 1) if room > 0 else []
        for number, text in enumerate(texts, next_line):
            planned = plan_line(self.state, parse_line(text.decode(), batch.endpoint), batch.id, number)
            member = f"{number}:{len(planned.req.job_ids)}"
            await redis_.sadd(keys.batch_in_flight(batch.id), member)
            await submit(self.state, planned)
            await redis_.hset(keys.batch(batch.id), "next", number + 1)
            in_flight.add(member)
        return next_line + len(texts)

    async def _collect(self, batch: BatchObject, in_flight: set[str]) -> None:
        """Every line whose jobs have all ended: its output line, once."""
        client = self.state.client
        members = sorted(in_flight)
        job_ids = {m: _job_ids(batch.id, m) for m in members}
        pipe = client.redis.pipeline(transaction=False)
        for member in members:
            for job_id in job_ids[member]:
                pipe.hget(client.keys.job(job_id), "status")
        statuses = iter(await pipe.execute())
        for member in members:
            found = [next(statuses) for _ in job_ids[member]]
            if all(s is not None and JobStatus(s.decode()).terminal for s in found):
                await self._record(batch, member)
                in_flight.discard(member)
            elif None in found:  # marked in flight by a process that died before submitting
                await self._resubmit(batch, member)

    async def _resubmit(self, batch: BatchObject, member: str) -> None:
        _, planned = await self._line(batch, member)
        await submit(self.state, planned)

    async def _line(self, batch: BatchObject, member: str) -> tuple[Line, Plan]:
        """An in-flight line, `number:jobs`, and its plan."""
        number = int(member.split(":")[0])
        text = await self.state.client.redis.lindex(self.state.client.keys.batch_lines(batch.id), number)
        line = parse_line(text.decode(), batch.endpoint)
        return line, plan_line(self.state, line, batch.id, number)

    async def _record(self, batch: BatchObject, member: str) -> None:
        client, number = self.state.client, int(member.split(":")[0])
        line, planned = await self._line(batch, member)
        ok, output = await self._output(line, planned, batch)
        pipe = client.redis.pipeline(transaction=True)
        pipe.hsetnx(client.keys.batch_results(batch.id), str(number), json.dumps({"ok": ok, "line": output}))
        pipe.srem(client.keys.batch_in_flight(batch.id), member)
        pipe.expire(client.keys.batch_results(batch.id), self.state.settings.file_ttl_s)
        first, _, _ = await pipe.execute()
        if first:
            await client.redis.hincrby(client.keys.batch(batch.id), "completed" if ok else "failed", 1)

    async def _output(self, line: Line, planned: Plan, batch: BatchObject) -> tuple[bool, dict[str, Any]]:
        """The line's output: the response body, or its error, as OpenAI writes them."""
        req = planned.req
        collector = Collector(req)
        cancelled = False
        for job_id in req.job_ids:
            record, events = await self.state.relay.snapshot(job_id)
            cancelled = cancelled or record.status == JobStatus.CANCELLED
            for event in events:
                collector.add(job_id, event)
        entry: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id}
        if collector.error is not None:
            status, kind, code = collector.error_kind()
            error = {"message": collector.error, "type": kind, "param": None, "code": code}
            return False, {**entry, "response": {"status_code": status, "request_id": req.id, "body": {"error": error}}, "error": None}
        if cancelled:
            code = "batch_cancelled" if batch.status == "cancelling" else "batch_expired"
            return False, {**entry, "response": None, "error": {"code": code, "message": f"the batch was {code[6:]} before this request ended"}}
        renderer = ENDPOINTS[batch.endpoint].renderer()
        body = renderer.response(req, collector.choices, collector.usage()).model_dump(mode="json")
        return True, {**entry, "response": {"status_code": 200, "request_id": req.id, "body": body}, "error": None}

    async def _cancel_jobs(self, batch_id: str, in_flight: set[str]) -> None:
        for member in in_flight:
            for job_id in _job_ids(batch_id, member):
                await self.state.client.cancel(job_id)

    async def _finish(self, batch: BatchObject, next_line: int) -> None:
        """Write the output and error files, in line order, and end the batch."""
        client, settings = self.state.client, self.state.settings
        results = await client.redis.hgetall(client.keys.batch_results(batch.id))
        ordered = [json.loads(results[k]) for k in sorted(results, key=int)]
        now = int(time.time())
        for ok, attr in ((True, "output_file_id"), (False, "error_file_id")):
            lines = [json.dumps(r["line"]) for r in ordered if r["ok"] == ok]
            if lines:
                stored = await files.store(
                    client, ("\n".join(lines) + "\n").encode(), f"{batch.id}_{attr[:-8]}.jsonl",
                    "batch_output", settings.file_ttl_s,
                )
                setattr(batch, attr, stored.id)
        if batch.status == "cancelling":
            batch.status, batch.cancelled_at = "cancelled", now
        elif next_line < batch.request_counts.total or time.time() > (batch.expires_at or 0):
            batch.status, batch.expired_at = "expired", now
        else:
            batch.status, batch.finalizing_at, batch.completed_at = "completed", now, now
        await _save(self.state, batch)
        pipe = client.redis.pipeline(transaction=True)
        pipe.srem(client.keys.active_batches, batch.id)
        pipe.delete(client.keys.batch_results(batch.id), client.keys.batch_lines(batch.id), client.keys.batch_lease(batch.id))
        await pipe.execute()


def _job_ids(batch_id: str, member: str) -> list[str]:
    """The job ids of an in-flight line, `number:jobs`, as `plan` names them."""
    number, count = (int(x) for x in member.split(":"))
    return job_ids(f"{batch_id}-{number}", count)
