"""Server-sent events: the line format, a response that always closes its stream and keeps an
idle one alive, and the disconnect watch for non-streaming requests."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

DONE = "data: [DONE]\n\n"
KEEPALIVE = b": keepalive\n\n"  # an SSE comment: every client skips it
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

T = TypeVar("T")


def format_sse(data: dict[str, Any] | str, event_id: str | None = None) -> str:
    """One event: optional `id:` line, one `data:` line of compact JSON, blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {payload}\n\n"


class EventStreamResponse(StreamingResponse):
    """`text/event-stream` whose generator is always closed when the response ends: Starlette
    stops iterating on a client disconnect but leaves the generator open, and the generator's
    cleanup is what cancels the request's jobs. While a stream has sent nothing for the app's
    GENQ_SSE_KEEPALIVE_S (its job waiting in a long queue), it sends a comment, so proxies that
    close idle connections (nginx's and load balancers' 60 s) leave it open."""

    media_type = "text/event-stream"

    def __init__(self, content: Any, **kwargs: Any) -> None:
        super().__init__(content, headers={**SSE_HEADERS, **kwargs.pop("headers", {})}, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = getattr(getattr(scope.get("app"), "state", None), "genq", None)
        interval = state.settings.sse_keepalive_s if state is not None else 0.0
        try:
            if interval > 0:
                await self._kept_alive(scope, receive, send, interval)
            else:
                await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()


    async def _kept_alive(self, scope: Scope, receive: Receive, send: Send, interval: float) -> None:
        """The stream, with a comment sent whenever nothing was for `interval` seconds; one lock
        keeps the comments and the stream's own messages apart."""
        lock = anyio.Lock()
        sent = {"at": time.monotonic(), "started": False, "ended": False}

        async def guarded(message: Message) -> None:
            async with lock:
                sent["started"] = sent["started"] or message["type"] == "http.response.start"
                sent["ended"] = message["type"] == "http.response.body" and not message.get("more_body", False)
                sent["at"] = time.monotonic()
                await send(message)

        async def keep_alive() -> None:
            while True:
                await anyio.sleep(interval / 4)
                async with lock:
                    if sent["ended"]:
                        return
                    if sent["started"] and time.monotonic() - sent["at"] >= interval:
                        await send({"type": "http.response.body", "body": KEEPALIVE, "more_body": True})
                        sent["at"] = time.monotonic()

        async with anyio.create_task_group() as group:
            group.start_soon(keep_alive)
            try:
                await super().__call__(scope, receive, guarded)
            finally:
                group.cancel_scope.cancel()


async def until_disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (its cleanup then cancels
    the jobs); raises ClientDisconnected in that case."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
