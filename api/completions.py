"""Completions' work (`POST /v1/completions`, and batch lines and jobs of that endpoint): what
genq refuses of a request (suffix, best_of, prompt embeddings out of bounds), and the response
or stream of its jobs."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from api import beam_search, generate
from api.deps import AppState
from api.errors import invalid_param
from api.render import CompletionRenderer
from api.request_bodies import CompletionRequest
from api.sse import EventStreamResponse, unless_disconnected


async def respond(state: AppState, body: CompletionRequest, request: Request) -> Any:
    """Prompt(s) as text or token ids; `stream: true` answers with SSE chunks."""
    reject_unsupported(body, state.settings.max_prompt_embeds_bytes)
    renderer = CompletionRenderer()
    if body.use_beam_search:
        return await unless_disconnected(request, beam_search.respond(state, body, body.prompts(), renderer))
    req = await generate.start(state, body, body.prompts(), renderer)
    if body.stream:
        return EventStreamResponse(generate.stream(state, req, renderer))
    return await unless_disconnected(request, generate.collect(state, req, renderer))


def reject_unsupported(body: CompletionRequest, max_embeds_bytes: int) -> None:
    """400 for what genq does not do, rather than silently ignoring it."""
    if body.prompt_embeds is not None:
        _check_embeds(body, max_embeds_bytes)
    elif not body.prompts() or any(p in ("", {"prompt_token_ids": []}) for p in body.prompts()):
        raise invalid_param("prompt", "prompt must be a non-empty string or token list")
    if body.suffix:
        raise invalid_param("suffix", "suffix is not supported")
    if body.best_of is not None and body.best_of != body.n:
        raise invalid_param("best_of", "best_of must equal n (no server-side ranking)")


def _check_embeds(body: CompletionRequest, max_bytes: int) -> None:
    """prompt_embeds alone, base64 within the size limit, not echoed (there is no text) nor
    beam searched."""
    if body.prompt not in (None, "", []):  # (vLLM's examples send an empty prompt beside them)
        raise invalid_param("prompt", "give either prompt or prompt_embeds, not both")
    given = [body.prompt_embeds] if isinstance(body.prompt_embeds, str) else body.prompt_embeds or []
    if not given:
        raise invalid_param("prompt_embeds", "prompt_embeds must be a base64 string or a non-empty list of them")
    for text in given:
        if len(text) * 3 // 4 > max_bytes:
            raise invalid_param("prompt_embeds", f"a prompt_embeds tensor may take at most {max_bytes} bytes "
                                "(GENQ_MAX_PROMPT_EMBEDS_BYTES)")
    for field, on in (("echo", body.echo), ("use_beam_search", body.use_beam_search)):
        if on:
            raise invalid_param(field, f"{field} needs the prompt's tokens: prompt_embeds has none")
    try:
        body.prompts()
    except ValueError as exc:
        raise invalid_param("prompt_embeds", str(exc)) from exc
