"""`POST /v1/completions`."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api import beam_search, generate
from api.deps import StateDep
from api.errors import invalid_param
from api.render import CompletionRenderer
from api.responses import CompletionResponse
from api.schemas import CompletionRequest
from api.sse import EventStreamResponse, unless_disconnected

router = APIRouter(tags=["openai"])


@router.post("/completions", response_model=CompletionResponse)
async def create_completion(body: CompletionRequest, request: Request, state: StateDep):
    """Prompt(s) as text or token ids; `stream: true` answers with SSE chunks."""
    reject_unsupported(body)
    renderer = CompletionRenderer()
    if body.use_beam_search:
        return await unless_disconnected(request, beam_search.respond(state, body, body.prompts(), renderer))
    req = await generate.start(state, body, body.prompts(), renderer)
    if body.stream:
        return EventStreamResponse(generate.stream(state, req, renderer))
    return await unless_disconnected(request, generate.collect(state, req, renderer))


def reject_unsupported(body: CompletionRequest) -> None:
    """400 for what genq does not do, rather than silently ignoring it."""
    if not body.prompts() or any(p in ("", {"prompt_token_ids": []}) for p in body.prompts()):
        raise invalid_param("prompt", "prompt must be a non-empty string or token list")
    if body.suffix:
        raise invalid_param("suffix", "suffix is not supported")
    if body.best_of is not None and body.best_of != body.n:
        raise invalid_param("best_of", "best_of must equal n (no server-side ranking)")
