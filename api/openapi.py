"""The error responses of the OpenAPI spec: what each operation really answers besides its
success, in the shape api.errors writes (OpenAI's; Anthropic's under /v1/messages).

Routers get them once, where api.main includes them (`responses=`); `prune` then drops from
each operation the ones it cannot give: FastAPI's 422 (api.errors answers validation errors
with a 400); where there is no body a 413, and the 429, 500 and 504 of submitting and relaying
jobs (a cancel submits nothing); a 404 where nothing is named (no path id, no body naming a model).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str  # invalid_request_error, server_error, timeout_error, service_unavailable, ...
    param: str | None = None  # the request field at fault, where one is
    code: str | None = None  # invalid_value, model_not_found, queue_full, redis_unavailable, ...


class ErrorResponse(BaseModel):
    """OpenAI's error: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str  # invalid_request_error, authentication_error, not_found_error, rate_limit_error, ...
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error, under /v1/messages: `{"type": "error", "error": {"type", "message"}}`."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class HealthResponse(BaseModel):
    """/health and /ping: `ok`, or `unavailable` with the reason (Redis away, no live worker)."""

    status: Literal["ok", "unavailable"]
    reason: str | None = None
    workers: int | None = None
    models: list[str] | None = None


WHEN = {
    400: "Invalid request: the field at fault in `param` (validation errors, values the sampling "
         "parameters refuse, empty inputs, a prompt plus max_tokens past max_model_len, a job the "
         "worker refused as the request's fault)",
    401: "Missing or invalid API key (GENQ_API_KEYS, genq keys)",
    404: "Unknown model, job, file, batch, response or conversation",
    413: "Request body over GENQ_MAX_REQUEST_BYTES (request_too_large), upload over its limit",
    429: "Queue full (GENQ_MAX_QUEUED_JOBS) or a rate limit reached; Retry-After says when to retry",
    500: "The job failed on the worker for a reason other than the request (job_failed)",
    503: "Redis unreachable (redis_unavailable, Retry-After), or no worker has published what is needed yet",
    504: "No end of the job within GENQ_REQUEST_TIMEOUT_S; its jobs are cancelled",
}


def errors(*statuses: int, model: type[BaseModel] = ErrorResponse) -> dict[int | str, dict[str, Any]]:
    """A `responses=` dict: each status with its description and the error model."""
    return {status: {"model": model, "description": WHEN[status]} for status in statuses}


# the multipart form of /v1/audio/*, which the routes read themselves (api.transcriptions)
AUDIO_FORM = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "model"],
    "properties": {"file": {"type": "string", "format": "binary"}, "model": {"type": "string"},
                   "language": {"type": "string"}, "prompt": {"type": "string"},
                   "response_format": {"type": "string", "enum": ["json", "text", "srt", "verbose_json", "vtt"]},
                   "temperature": {"type": "number"}}}}}}}


GUARDED = errors(400, 401, 404, 413, 503)  # routes behind the API key check
SUBMITS = errors(400, 401, 404, 413, 429, 503)  # ... that queue work (backpressure, rate limits)
GENERATES = errors(400, 401, 404, 413, 429, 500, 503, 504)  # ... and relay its jobs to their end
ANTHROPIC = errors(400, 401, 404, 413, 429, 500, 503, 504, model=AnthropicErrorResponse)
HEALTH: dict[int | str, dict[str, Any]] = {
    503: {"model": HealthResponse, "description": "Redis unreachable or no live worker"},
}

WITH_A_BODY = ("413", "429", "500", "504")  # too large, or what submitting and relaying jobs may answer


def install(app: FastAPI) -> None:
    """Serve the spec with each operation's errors pruned to the ones it can give."""
    built = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = prune(built())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def prune(spec: dict[str, Any]) -> dict[str, Any]:
    """`spec` without the error responses its operations cannot give (see the module docstring)."""
    for path, operations in spec.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.get("responses", {})
            responses.pop("422", None)
            has_body = "requestBody" in operation
            for status in WITH_A_BODY if not has_body else ():
                responses.pop(status, None)
            if "{" not in path and not has_body:
                responses.pop("404", None)
            for status, response in responses.items():
                content = response.get("content", {})
                if status >= "400" and content and "application/json" not in content:
                    # (FastAPI files them under the route's media type: a text route's errors are JSON too)
                    response["content"] = {"application/json": next(iter(content.values()))}
    schemas = spec.get("components", {}).get("schemas", {})
    if not any("HTTPValidationError" in str(ops) for ops in spec.get("paths", {}).values()):
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
    return spec
