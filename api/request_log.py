"""A line per request (GENQ_LOG_REQUESTS, vLLM's --enable-log-requests without the prompts):
who asked what of which model, what came of it and how long it took, as JSON on the logger
`genq.requests`, for an operator to follow a complaint or a slow request to its jobs. Prompts
and outputs are never written.

`RequestLog` (plain ASGI middleware: a streamed response's line is written when its stream
ends) keeps a record per request in a context variable; what it cannot see from the outside
is noted into that record by who knows it: the key's name (deps.require_api_key), and each
relayed generation's jobs, tokens and endings (generate.relay_events, via `Relayed`). What a
request starts and which ends after it (a background response) has a line of its own
(`background_line`).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Awaitable
from contextvars import ContextVar
from typing import Any, TypeVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from producer.protocol import Event

log = logging.getLogger("genq.requests")
RECORD: ContextVar[dict[str, Any] | None] = ContextVar("genq_request_record", default=None)
REQUEST_ID_SCOPE_KEY = "genq.request_id"  # where RequestIdHeader leaves the request's id
T = TypeVar("T")


def note(**fields: Any) -> None:
    """Add `fields` to the current request's line (nothing when requests are not logged)."""
    record = RECORD.get()
    if record is not None:
        record.update(fields)


class Relayed:
    """What one relayed generation came to, noted on the request's line as its events pass:
    its jobs, tokens (the jobs' own counts), time to the first token, each completion's end."""

    def __init__(self, response_id: str, job_ids: list[str], model: str) -> None:
        self.record = RECORD.get()
        self.start = time.monotonic()
        self.usage: dict[str, dict[str, int]] = {}  # job id -> its latest counts
        self.endings: dict[str, int] = {}  # finish reason -> completions that ended so
        if self.record is not None:
            self.record.update(response_id=response_id, model=model, jobs=list(job_ids))

    def on_event(self, job_id: str, event: Event) -> None:
        if self.record is None:
            return
        if event.token_ids and "ttft_s" not in self.record:
            self.record["ttft_s"] = round(time.monotonic() - self.start, 4)
        if event.usage:
            counts = self.usage.setdefault(job_id, {})
            for name, value in event.usage.items():
                counts[name] = max(counts.get(name, 0), value)
        if event.finished and event.finish_reason:
            self.endings[event.finish_reason] = self.endings.get(event.finish_reason, 0) + 1
        if event.error is not None:  # (the job failed: its request's outcome too)
            self.record["error"] = event.error

    def on_close(self, outcome: str) -> None:
        """`outcome`: "completed", "cancelled" (the client went first), "timeout", "failed"."""
        if self.record is None:
            return
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            self.record[name] = sum(counts.get(name, 0) for counts in self.usage.values())
        failed = outcome == "completed" and "error" in self.record
        self.record.update(finish_reasons=self.endings, outcome="failed" if failed else outcome)


async def background_line(work: Awaitable[T]) -> T:
    """Await `work`, which a request started and which ends after it (a background response
    finishing), under a line of its own, written when it ends: the request's id, path and key,
    method `BACKGROUND`, no status, and what the relay notes (its jobs, tokens, outcome)."""
    request = RECORD.get()
    if request is None:  # (requests are not logged)
        return await work
    record: dict[str, Any] = {name: request[name] for name in ("request_id", "path", "key") if name in request}
    record["method"] = "BACKGROUND"
    token, start = RECORD.set(record), time.monotonic()
    try:
        return await work
    finally:
        RECORD.reset(token)
        _write(record, time.monotonic() - start)


class RequestLog:
    """With GENQ_LOG_REQUESTS: one JSON line per request to the API (probes and scrapes
    aside) on `genq.requests`, once its response ended: method, path, status, seconds, the
    request id (X-Request-Id), the key's name, and for a generation its response id, model,
    jobs, token counts, time to first token, finish reasons and outcome."""

    def __init__(self, app: ASGIApp, skipped: frozenset[str] = frozenset()) -> None:
        self.app, self.skipped = app, skipped
        if log.level == logging.NOTSET:
            log.setLevel(logging.INFO)
        if not log.handlers and not logging.getLogger().handlers:  # uvicorn sets up its own loggers
            handler = logging.StreamHandler(sys.stderr)  # only: without this the lines go nowhere
            handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
            log.addHandler(handler)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.skipped:
            await self.app(scope, receive, send)
            return
        request_id = scope.get(REQUEST_ID_SCOPE_KEY, b"")
        record: dict[str, Any] = {
            "request_id": request_id.decode(errors="replace") if isinstance(request_id, bytes) else request_id,
            "method": scope["method"], "path": scope["path"], "status": None,  # (None: no response began)
        }
        start = time.monotonic()

        async def send_seen(message: Message) -> None:
            if message["type"] == "http.response.start":
                record["status"] = message["status"]
            await send(message)

        token = RECORD.set(record)
        try:
            await self.app(scope, receive, send_seen)
        finally:
            RECORD.reset(token)
            _write(record, time.monotonic() - start)


def _write(record: dict[str, Any], duration_s: float) -> None:
    record["duration_s"] = round(duration_s, 4)
    log.info("%s", json.dumps(record, separators=(",", ":")))
