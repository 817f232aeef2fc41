"""Request bodies over GENQ_MAX_REQUEST_BYTES are refused at the door: a 413 before the route
runs, so nothing of such a request reaches Redis.

A body that declares its length (Content-Length) is refused before a byte of it is read; a
chunked one as soon as what arrived passes the limit. Multipart uploads (`/v1/files`, audio)
are left to their routes, which hold them to their own limits (GENQ_MAX_FILE_BYTES,
GENQ_MAX_AUDIO_BYTES). Plain ASGI: streamed responses pass through as they are.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(HTTPException):
    """A request body over the limit (api.errors answers it as a 413, `request_too_large`).
    An HTTPException, so FastAPI's body reading passes it on rather than calling it a 400."""

    def __init__(self, size_bytes: int | None, limit_bytes: int) -> None:
        size = f"{size_bytes} bytes" if size_bytes is not None else "more bytes"
        super().__init__(413, f"The request body is {size}, over this server's limit of {limit_bytes} bytes "
                              "(GENQ_MAX_REQUEST_BYTES).")


class BodyLimit:
    """Raise BodyTooLarge from `receive` once a request's body is known to be over `limit_bytes`."""

    def __init__(self, app: ASGIApp, limit_bytes: int) -> None:
        self.app = app
        self.limit_bytes = limit_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"]) if scope["type"] == "http" else {}
        if scope["type"] != "http" or headers.get(b"content-type", b"").startswith(b"multipart/form-data"):
            await self.app(scope, receive, send)
            return
        declared = headers.get(b"content-length", b"")
        declared_bytes = int(declared) if declared.isdigit() else None
        received_bytes = 0

        async def limited() -> Message:
            nonlocal received_bytes
            if declared_bytes is not None and declared_bytes > self.limit_bytes:
                raise BodyTooLarge(declared_bytes, self.limit_bytes)
            message = await receive()
            received_bytes += len(message.get("body", b""))
            if received_bytes > self.limit_bytes:
                raise BodyTooLarge(None, self.limit_bytes)
            return message

        await self.app(scope, limited, send)
