"""`POST /v1/chat/completions`: the worker applies the model's chat template."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from api import beam_search, generate
from api.deps import StateDep
from api.errors import invalid_param
from api.render import ChatRenderer
from api.responses import ChatCompletionResponse
from api.schemas import ChatCompletionRequest, ChatMessage, PromptInput
from api.settings import Settings
from api.sse import EventStreamResponse, unless_disconnected

router = APIRouter(tags=["openai"])


@router.post("/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest, request: Request, state: StateDep):
    """Messages in, one assistant message per choice out; `stream: true` answers with SSE."""
    renderer = ChatRenderer()
    check_tool_parser(body, state.settings)
    if body.use_beam_search:
        return await unless_disconnected(request, beam_search.respond(state, body, [chat_prompt(body)], renderer))
    req = await generate.start(state, body, [chat_prompt(body)], renderer)
    if body.stream:
        return EventStreamResponse(generate.stream(state, req, renderer))
    return await unless_disconnected(request, generate.collect(state, req, renderer))


def check_tool_parser(body: ChatCompletionRequest, settings: Settings) -> None:
    """400 for tool_choice "auto" where the deployment turned it off."""
    if body.tool_calls_form() == "hermes" and settings.tool_call_parser == "none":
        raise invalid_param(
            "tool_choice", 'tool_choice "auto" (the default with tools) is off on this server '
            "(GENQ_TOOL_CALL_PARSER=none): name the function, or use \"none\"",
        )


def chat_prompt(body: ChatCompletionRequest) -> PromptInput:
    """The messages as the protocol carries them ({role, content: str}), with the tools
    unless tool_choice is "none" and what else the template gets; 400 for what genq does not
    support."""
    if not body.messages:
        raise invalid_param("messages", "messages must be a non-empty list")
    messages = [_message(m, i) for i, m in enumerate(body.messages)]
    prompt: dict[str, Any] = {"messages": messages}
    if body.tools and body.tool_choice != "none":
        prompt["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    if kwargs := body.template_kwargs():
        prompt["chat_template_kwargs"] = kwargs
    return prompt if len(prompt) > 1 else messages


def _message(message: ChatMessage, i: int) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        for part in content:
            if part.type != "text" or part.text is None:
                raise invalid_param(f"messages[{i}].content", f"only text content parts are supported, got a "
                                    f"{part.type!r} part (image-text models serve text in, text out here)")
        content = "".join(part.text or "" for part in content)
    extra = {k: v for k, v in (("tool_calls", message.tool_calls), ("tool_call_id", message.tool_call_id),
                               ("name", message.name)) if v is not None}
    return {"role": message.role, "content": content or "", **extra}
