"""Errors in OpenAI's format: `{"error": {"message", "type", "param", "code"}}`; under
Anthropic's routes (/v1/messages), and to Anthropic's clients (which send `anthropic-version`),
in Anthropic's: `{"type": "error", "error": {"type", "message"}}`.

Routes raise `APIError`; the handlers below also turn FastAPI's validation errors (422) into
400s naming the field, and Starlette's HTTP errors (404, 405) into the same shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from api.body_limit import BodyTooLarge

INVALID_REQUEST = "invalid_request_error"


class APIError(Exception):
    """An error response: HTTP status, OpenAI error fields, extra headers (Retry-After)."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def renamed(exc: APIError, names: dict[str, str]) -> APIError:
    """A 400 from the chat machinery, naming the field as a request of another API (Responses,
    Messages) that ran as chat names it: `names` maps chat's top-level fields to its."""
    if exc.param is not None:
        head, _, rest = exc.param.partition(".")
        exc.param = names.get(head, head) + (f".{rest}" if rest else "")
    return exc


def not_found(what: str, code: str, param: str | None = None) -> APIError:
    return APIError(404, what, param=param, code=code)


def invalid_param(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def param_from_value_error(exc: ValueError, aliases: dict[str, str]) -> str | None:
    """The field a `SamplingParams` / `Job` ValueError names: its message starts with it.
    `aliases` maps an internal name to the request's (chat's `top_logprobs` is `logprobs`)."""
    first = str(exc).split(" ", 1)[0].split("[", 1)[0]
    if not first.isidentifier():
        return None
    return aliases.get(first, first)


def validation_param(loc: Sequence[int | str]) -> str | None:
    """`("body", "messages", 0, "content")` -> `messages[0].content`. Tags of unions that
    pydantic puts in the path (`chat`, `completion`, `str`, `list[int]`) are dropped."""
    parts = list(loc[1:] if loc and loc[0] in ("body", "query", "header", "path") else loc)
    param = ""
    for part in parts:
        if isinstance(part, int):
            param += f"[{part}]"
        elif not _is_union_tag(part):
            param += f".{part}" if param else part
    return param or None


def _is_union_tag(part: str) -> bool:
    return part in ("chat", "completion") or "[" in part or part in ("str", "int", "float", "bool")


def _validation_message(error: dict[str, Any], param: str | None) -> str:
    if error.get("type") == "missing":
        return f"Missing required parameter: '{param}'."
    if error.get("type") == "json_invalid":
        return f"The request body is not valid JSON: {error.get('msg')}"
    where = f"'{param}'" if param else "the request body"
    return f"Invalid value for {where}: {error.get('msg')}"


ANTHROPIC_PATHS = ("/v1/messages",)
# Anthropic's error types by status (others: api_error)
ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error",
}


def _respond(request: Request, body: dict[str, Any], status: int, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """An error response in OpenAI's shape, or Anthropic's under its routes and to its clients
    (the field named ahead of the message, as Anthropic names it)."""
    if request.url.path.startswith(ANTHROPIC_PATHS) or "anthropic-version" in request.headers:
        error = body["error"]
        message = f"{error['param']}: {error['message']}" if error.get("param") else error["message"]
        body = {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return _respond(request, exc.body(), exc.status_code, exc.headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    first = errors[0] if errors else {}
    param = validation_param(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        param = None
    return _respond(request, error_body(_validation_message(first, param), param=param, code="invalid_value"), 400)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    kind = "server_error" if exc.status_code >= 500 else INVALID_REQUEST
    return _respond(request, error_body(str(exc.detail), kind), exc.status_code, exc.headers)


async def _too_large(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, BodyTooLarge)
    return _respond(request, error_body(str(exc.detail), code="request_too_large"), 413)


async def _redis_error(request: Request, exc: Exception) -> JSONResponse:
    """503 with Retry-After: the API serves again by itself once Redis is back (its pool
    connects anew on the next command)."""
    state = getattr(request.app.state, "genq", None)
    retry_after_s = state.settings.retry_after_s if state is not None else 1
    return _respond(request, error_body(f"Redis unreachable: {exc}", "server_error", code="redis_unavailable"), 503,
                    headers={"Retry-After": str(retry_after_s)})


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    """Anything unexpected: still OpenAI's shape (Starlette logs the traceback)."""
    return _respond(request, error_body(f"{type(exc).__name__}: {exc}", "server_error", code="internal_error"), 500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(BodyTooLarge, _too_large)
    app.add_exception_handler(redis.ConnectionError, _redis_error)
    app.add_exception_handler(redis.TimeoutError, _redis_error)
    app.add_exception_handler(Exception, _internal_error)
