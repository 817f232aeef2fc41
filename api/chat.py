"""Chat completions' work, for `POST /v1/chat/completions` and for every API that runs as a
chat (Responses, Messages, audio, batch lines, jobs, /tokenize): the deployment's template
defaults, the tool-parser check, the messages as the protocol carries them, the token ids a
chat job would run on, and submitting the job."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from api import beam_search, generate
from api.deps import AppState
from api.errors import APIError, invalid_param, param_from_value_error
from api.images import audio_part, image_part, inline_media_urls, url_of
from api.render import ChatRenderer, RelayedRequest, Renderer
from api.request_bodies import ChatCompletionRequest, ChatMessage, ContentPart, PromptInput
from api.settings import Settings
from api.sse import EventStreamResponse, unless_disconnected
from api.tokenizers import job_prompt_ids
from producer.jobs import build_job


async def respond(state: AppState, body: ChatCompletionRequest, request: Request) -> Any:
    """Messages in, one assistant message per choice out; `stream: true` answers with SSE."""
    renderer = ChatRenderer()
    if body.use_beam_search:  # (start templates the others)
        body = templated(body, state.settings)
        check_tool_parser(body, state.settings)
        if any(m.has_images() for m in body.messages):
            raise invalid_param("use_beam_search", "beam search over messages with images is not supported")
        return await unless_disconnected(request, beam_search.respond(state, body, [chat_prompt(body)], renderer))
    req = await start(state, body, renderer)
    if body.stream:
        return EventStreamResponse(generate.stream(state, req, renderer))
    return await unless_disconnected(request, generate.collect(state, req, renderer))


async def start(state: AppState, chat: ChatCompletionRequest, renderer: Renderer) -> RelayedRequest:
    """Submit a chat request's job, its image URLs fetched first; raises APIError. Also for
    requests of the APIs that run as chat (Responses, Messages)."""
    chat = templated(chat, state.settings)
    check_tool_parser(chat, state.settings)
    await inline_media_urls(chat.messages, state.settings)
    return await generate.start(state, chat, [chat_prompt(chat)], renderer)


def templated(chat: ChatCompletionRequest, settings: Settings) -> ChatCompletionRequest:
    """The request with the deployment's default template variables under its own."""
    defaults = settings.default_chat_template_kwargs
    if not defaults:
        return chat
    return chat.model_copy(update={"chat_template_kwargs": {**defaults, **(chat.chat_template_kwargs or {})}})


def check_tool_parser(body: ChatCompletionRequest, settings: Settings) -> None:
    """400 for tool_choice "auto" where the deployment turned it off."""
    if body.tool_calls_form() == "auto" and settings.tool_call_parser == "none":
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
    for i, message in enumerate(body.messages):
        if message.content == []:
            raise invalid_param(f"messages[{i}].content", "content must be text or a non-empty list of parts")
    if not any(m.content or m.tool_calls for m in body.messages):
        # (an empty conversation would have the model write on from its template alone, up to max_model_len)
        raise invalid_param("messages", "the messages hold no content: at least one must have some")
    messages = [_message(m, i) for i, m in enumerate(body.messages)]
    prompt: dict[str, Any] = {"messages": messages}
    if body.tools and body.tool_choice != "none":
        prompt["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    if kwargs := body.template_kwargs():
        prompt["chat_template_kwargs"] = kwargs
    return prompt if len(prompt) > 1 else messages


def _message(message: ChatMessage, i: int) -> dict[str, Any]:
    """Text parts are joined into one string; with an image among them the parts go as they
    are, each image as its bytes (api.images)."""
    content: Any = message.content
    if isinstance(content, list):
        parts = [_part(part, f"messages[{i}].content[{j}]") for j, part in enumerate(content)]
        text_only = all(part["type"] == "text" for part in parts)
        content = "".join(part["text"] for part in parts) if text_only else parts
    extra = {k: v for k, v in (("tool_calls", message.tool_calls), ("tool_call_id", message.tool_call_id),
                               ("name", message.name)) if v is not None}
    return {"role": message.role, "content": content or "", **extra}


def _part(part: ContentPart, where: str) -> dict[str, Any]:
    if part.type == "text" and part.text is not None:
        return {"type": "text", "text": part.text}
    if part.type == "image_url":
        return image_part(url_of(part), f"{where}.image_url")
    if part.type in ("input_audio", "audio_url"):
        return audio_part(part, f"{where}.{part.type}")
    raise invalid_param(where, f"content parts are text, image_url, input_audio or audio_url, got a {part.type!r} part")


def chat_ids(tokenizer: Any, chat: ChatCompletionRequest) -> list[int]:
    """The ids a chat request's job would run on: the chat endpoint's own prompt (messages,
    tools, template variables) made into a job, which checks it as any job is checked, and
    rendered as the worker renders it."""
    try:
        job = build_job(chat_prompt(chat))
    except ValueError as exc:  # what a chat job refuses (reserved template variables, ...)
        raise APIError(400, str(exc), param=param_from_value_error(exc, {}), code="invalid_value") from None
    try:
        return job_prompt_ids(tokenizer, job)
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
