"""Anthropic's Messages API (`POST /v1/messages`) on top of chat, as vLLM serves it for clients
written against Anthropic's SDK (Claude Code among them): a request is translated into a chat
completion request, run as one job like any other, and its reply rendered as a message (content
blocks: thinking, text, tool_use) or as the Messages stream events.

What is supported: `system` (text or text blocks), `messages` with text, image (base64 or URL),
plain-text document, `tool_use` and `tool_result` blocks, a last assistant message the reply goes on from (a
prefill), `max_tokens`, `stop_sequences`, `temperature`, `top_p`, `top_k`, client `tools` with
`tool_choice` (auto, any, tool, none; `disable_parallel_tool_use`), `thinking` (enabled or
disabled: the chat template's switch; adaptive: the model's default; a deployment's reasoning
parser makes the thinking a `thinking` block), `output_config` (`format`: a JSON schema the
reply follows, guided as chat's json_schema; `effort`: the template's reasoning_effort),
`stream`, and chat's sampling extras (`seed`, `ignore_eos`, ...). Prompt caching needs no
`cache_control`: the workers cache every prefix, and `usage` says how much of the prompt they
read from cache. Server tools, documents other than plain text, MCP servers and containers
are a 400 naming the field. `POST /v1/messages/count_tokens` counts a request's input tokens.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from api.deps import AppState
from api.errors import invalid_param
from api.generate import Collector, StreamError, relayed_chunks
from api.parsers.reasoning import TAGS as THINK_TAGS
from api.render import ChatRenderer, RelayedRequest
from api.request_bodies import ChatCompletionRequest
from api.response_bodies import ChatCompletionResponse, Usage
from api.settings import Settings


class MessagesRequest(BaseModel):
    # other fields are kept: chat's sampling extras (seed, ignore_eos, ...) pass on
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]]
    max_tokens: int
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None  # {"type": "auto" | "any" | "tool" | "none", "name", ...}
    # {"type": "enabled", "budget_tokens": n}, {"type": "disabled"} or {"type": "adaptive"}
    thinking: dict[str, Any] | None = None
    # {"effort": "low" ... "max", "format": {"type": "json_schema", "schema": {...}}}
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's place for output_config.format
    metadata: dict[str, Any] | None = None


class CountTokensRequest(BaseModel):
    """`POST /v1/messages/count_tokens`: what shapes the prompt, without max_tokens."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


class MessageRenderer(ChatRenderer):
    """Chat's renderer with the Messages API's id prefix."""

    id_prefix = "msg_"


# ---------------------------------------------------------------------------------------------
# Request: Messages -> chat


# reasoning parsers whose thinking lies between tags, which workers can hold to a budget
THINK_TAG_PARSERS = (*THINK_TAGS, "deepseek_v3")


def think_tags(settings: Settings) -> bool:
    """Whether the deployment reads thinking between tags (its replies' thinking can be budgeted)."""
    return settings.reasoning_parser in THINK_TAG_PARSERS


# Anthropic's fields genq has nothing for: a 400 naming them rather than a reply that ignored them
REFUSED = {"mcp_servers": "MCP servers", "container": "containers"}
# chat fields a Messages request sets through its own, or that have no meaning here
CHAT_ONLY = {
    "messages", "max_tokens", "max_completion_tokens", "stop", "tools", "tool_choice", "parallel_tool_calls",
    "stream", "stream_options", "n", "logprobs", "top_logprobs", "echo", "prompt_logprobs", "response_format",
    "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "background", "include_reasoning",
    "reasoning_effort", "thinking_token_budget", "service_tier",  # (Anthropic's tiers are other names)
}
# chat fields a 400 may name, as a Messages request names them
PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}


def to_chat(request: MessagesRequest | CountTokensRequest, think_tags: bool = False) -> ChatCompletionRequest:
    """The chat request that does what `request` asks; APIError naming the field otherwise.
    `think_tags`: the deployment reads thinking between <think> tags (a reasoning parser), so
    the workers can hold it to thinking.budget_tokens."""
    extra = request.model_extra or {}
    for field, what in REFUSED.items():
        if field in extra:
            raise invalid_param(field, f"{what} are not supported here")
    messages = [{"role": "system", "content": _system(request.system)}] if request.system else []
    if not request.messages:
        raise invalid_param("messages", "messages must be a non-empty list")
    for i, message in enumerate(request.messages):
        _check_not_empty(message, f"messages.{i}", last=i == len(request.messages) - 1)
        messages += _chat_messages(message, f"messages.{i}")
    passed_on = set(ChatCompletionRequest.model_fields) - CHAT_ONLY
    body: dict[str, Any] = {k: v for k, v in extra.items() if k in passed_on}
    body.update(model=request.model, messages=messages)
    if isinstance(request, MessagesRequest):
        # Anthropic's: a reply stops where the context window ends (model_context_window_exceeded)
        body["max_tokens"], body["clamp_max_tokens"] = request.max_tokens, True
        sampling = (("temperature", request.temperature), ("top_p", request.top_p), ("top_k", request.top_k),
                    ("stop", request.stop_sequences))
        body.update({k: v for k, v in sampling if v is not None})
    if messages[-1]["role"] == "assistant":  # a prefill: the reply goes on from it
        body["continue_final_message"] = True
    if request.tools:
        body["tools"] = [_chat_tool(tool, f"tools.{i}") for i, tool in enumerate(request.tools)]
    body.update(_tool_choice(request.tool_choice))
    if request.thinking is not None:
        body.update(_thinking(request.thinking, think_tags and isinstance(request, MessagesRequest)))
    body.update(_output_config(request))
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise invalid_param(".".join(str(p) for p in first["loc"]), first["msg"]) from None


def _system(system: str | list[dict[str, Any]]) -> str:
    if isinstance(system, str):
        return system
    for i, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise invalid_param(f"system.{i}.type", "system blocks must be text blocks")
    return "\n".join(block.get("text") or "" for block in system)


def _check_not_empty(message: Any, where: str, last: bool) -> None:
    """Anthropic's rule: every message has content but a final assistant one (a prefill)."""
    if isinstance(message, dict) and message.get("content") in ("", []) and not (last and message.get("role") == "assistant"):
        raise invalid_param(f"{where}.content", "all messages must have non-empty content except for the optional "
                            "final assistant message")


def _chat_messages(message: Any, where: str) -> list[dict[str, Any]]:
    """One Messages message as chat messages: a user's tool results become tool messages
    (before the rest of its content), an assistant's tool_use blocks its tool calls."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise invalid_param(f"{where}.role", "a message's role must be user or assistant")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid_param(f"{where}.content", "content must be a string or a list of content blocks")
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": block.get("text") or ""})
        elif kind == "image" and role == "user":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), at)}})
        elif kind == "document" and role == "user":
            parts.append({"type": "text", "text": _document(block, at)})
        elif kind == "tool_result" and role == "user":
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": _result(block, at)})
        elif kind == "tool_use" and role == "assistant":
            arguments = json.dumps(block.get("input") or {})
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": arguments}})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier turns' thinking: chat templates leave it out of the prompt too
        else:
            raise invalid_param(f"{at}.type", f"{role} content blocks of type {kind!r} are not supported "
                                f"({'text, image, document, tool_result' if role == 'user' else 'text, tool_use, thinking'})")
    if parts or calls or not out:
        out.append({"role": role, "content": _joined(parts), **({"tool_calls": calls} if calls else {})})
    return out


def _joined(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text parts as one string; with an image among them, the parts as they are."""
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _image_url(source: Any, where: str) -> str:
    """An image block's source as the URL chat takes: a data URL for base64 data."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        return f"data:{source.get('media_type')};base64,{source.get('data')}"
    if kind == "url":
        return str(source.get("url"))
    raise invalid_param(f"{where}.source.type", f"image sources are base64 or url, got {kind!r}")


def _document(block: dict[str, Any], where: str) -> str:
    """A plain-text document's text (under its title, when it has one); other sources (PDF,
    files) are a 400 naming the source."""
    source = block.get("source")
    if not isinstance(source, dict):
        source = {}
    if source.get("type") != "text" or not isinstance(source.get("data"), str):
        raise invalid_param(f"{where}.source.type", "documents are plain text ({\"type\": \"text\", \"data\": ...}), "
                            f"got a {source.get('type')!r} source")
    title = block.get("title")
    return f"{title}\n\n{source['data']}" if title else source["data"]


def _result(block: dict[str, Any], where: str) -> str:
    """A tool result's content as text (an error result says it is one, as Anthropic shows it)."""
    content = block.get("content")
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
            raise invalid_param(f"{where}.content", "tool results are text: images in them are not supported")
        content = "".join(part.get("text") or "" for part in content)
    text = content if isinstance(content, str) else ""
    return f"Error: {text}" if block.get("is_error") else text


def _chat_tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise invalid_param(f"{where}.type", f"only client tools (name, input_schema) are supported, not {kind!r}")
    if not tool.get("name"):
        raise invalid_param(f"{where}.name", "a tool needs a name")
    function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    for field in ("description", "strict"):  # strict: its calls' inputs are held to the schema
        if tool.get(field) is not None:
            function[field] = tool[field]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any] | None) -> dict[str, Any]:
    """Chat's tool_choice and parallel_tool_calls for Anthropic's tool_choice."""
    if choice is None:
        return {}
    kind = choice.get("type")
    forms: dict[Any, Any] = {"auto": "auto", "any": "required", "none": "none",
                             "tool": {"type": "function", "function": {"name": choice.get("name")}}}
    if kind not in forms:
        raise invalid_param("tool_choice.type", f"tool_choice type must be auto, any, tool or none, got {kind!r}")
    return {"tool_choice": forms[kind], "parallel_tool_calls": not choice.get("disable_parallel_tool_use", False)}


def _thinking(thinking: dict[str, Any], budgeted: bool) -> dict[str, Any]:
    """Chat's fields for Anthropic's thinking: the chat template's switch, under the names
    templates read it by (Qwen3's enable_thinking, DeepSeek-V3.1's thinking), or the model's
    own default ("adaptive"); thinking the client asked not to see left out of the reply;
    `budgeted`: budget_tokens as the thinking_token_budget the workers hold it to."""
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise invalid_param("thinking.type", f"thinking type must be enabled, disabled or adaptive, got {kind!r}")
    fields: dict[str, Any] = {"include_reasoning": thinking.get("display") != "omitted"}
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise invalid_param("thinking.budget_tokens", f"budget_tokens must be an integer >= 0, got {budget!r}")
        if budgeted:
            fields["thinking_token_budget"] = budget
    if kind != "adaptive":
        fields["chat_template_kwargs"] = {"enable_thinking": kind == "enabled", "thinking": kind == "enabled"}
    return fields


EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def _output_config(request: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """Chat's response_format for a JSON schema the reply must follow, and its reasoning_effort
    (the chat template's variable) for Anthropic's effort."""
    config = request.output_config or {}
    fields: dict[str, Any] = {}
    if config.get("effort") is not None:
        if config["effort"] not in EFFORTS:
            raise invalid_param("output_config.effort", f"effort must be one of {', '.join(EFFORTS)}, got {config['effort']!r}")
        fields["reasoning_effort"] = EFFORTS[config["effort"]]
    where, fmt = "output_config.format", config.get("format")
    if fmt is None and isinstance(request, MessagesRequest):
        where, fmt = "output_format", request.output_format
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise invalid_param(where, 'an output format is {"type": "json_schema", "schema": {...}}')
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    return fields


# ---------------------------------------------------------------------------------------------
# Response: chat -> Messages

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"]


def stop_reason(finish_reason: str | None, matched: int | str | None, stop: list[str] | None,
                called: bool, short: bool = False) -> StopReason:
    """Anthropic's stop_reason for a chat choice's finish_reason, what matched (a stop string
    or token id), and whether it called a tool (a forced call finishes as "stop" in chat);
    `short`: the reply wrote fewer tokens than max_tokens allowed (a "length" finish then is
    the context's end)."""
    if finish_reason == "length":
        return "model_context_window_exceeded" if short else "max_tokens"
    if called:
        return "tool_use"
    if isinstance(matched, str) and matched in (stop or []):
        return "stop_sequence"
    return "end_turn"


def message_usage(usage: Usage) -> dict[str, int]:
    """Anthropic's usage: input_tokens are those not read from cache (as Anthropic counts
    them), cache_read_input_tokens those the prefix cache served."""
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {"input_tokens": usage.prompt_tokens - cached, "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def message_object(request: MessagesRequest, chat: ChatCompletionResponse) -> dict[str, Any]:
    """The message for a finished chat completion (its one choice)."""
    choice = chat.choices[0]
    message = choice.message
    content: list[dict[str, Any]] = []
    if message.reasoning_content:
        content.append(thinking_block(message.reasoning_content))
    if message.content:
        content.append({"type": "text", "text": message.content})
    for call in message.tool_calls or []:
        function = call["function"]
        content.append(tool_use_block(call["id"], function["name"], _input(function["arguments"])))
    reason = stop_reason(choice.finish_reason, choice.stop_reason, request.stop_sequences, bool(message.tool_calls),
                         short=chat.usage.completion_tokens < request.max_tokens)
    return {**envelope(chat.id, chat.model), "content": content, "stop_reason": reason,
            "stop_sequence": choice.stop_reason if reason == "stop_sequence" else None,
            "usage": message_usage(chat.usage)}


def envelope(message_id: str, model: str) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model}


def thinking_block(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}  # genq signs nothing


def tool_use_block(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use input (an object). The readers only pass calls whose
    arguments are JSON; anything but an object goes under "value"."""
    value = json.loads(arguments or "{}")
    return value if isinstance(value, dict) else {"value": value}


# ---------------------------------------------------------------------------------------------
# Streaming: the chat renderer's deltas as Messages events


class MessageEvents:
    """Turns one choice's chat deltas into Messages stream events, opening and closing content
    blocks (thinking, text, tool_use) as the kind of delta changes."""

    def __init__(self, req: RelayedRequest) -> None:
        self.req = req
        self.index = -1  # of the open block's, or the last one's
        self.open: str | None = None  # kind of the open block
        self.json_begun = False  # the open tool_use block's input has more than whitespace

    @staticmethod
    def event(kind: str, **fields: Any) -> str:
        body = {"type": kind, **fields}
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"

    def start(self, input_tokens: int) -> str:
        shell = {**envelope(self.req.id, self.req.model), "content": [], "stop_reason": None,
                 "stop_sequence": None, "usage": {"input_tokens": input_tokens, "output_tokens": 0}}
        return self.event("message_start", message=shell)

    def delta(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        calls = delta.get("tool_calls") or []
        if delta.get("reasoning_content"):
            out += self._block("thinking", thinking_block(""), {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
        for call in calls:  # the open call's further arguments were written before any content
            out += self._call(call) if not call.get("id") else []
        if delta.get("content"):
            out += self._block("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": delta["content"]})
        for call in calls:
            out += self._call(call) if call.get("id") else []
        return out

    def _block(self, kind: str, shell: dict[str, Any], delta: dict[str, Any]) -> list[str]:
        out = [] if self.open == kind else self._open(kind, shell)
        return [*out, self.event("content_block_delta", index=self.index, delta=delta)]

    def _call(self, call: dict[str, Any]) -> list[str]:
        """A call's first piece (it has the id) opens a tool_use block; later pieces add to
        its input's JSON."""
        function = call.get("function") or {}
        out = self._open("tool_use", tool_use_block(call["id"], function.get("name", ""), {})) if call.get("id") else []
        # whitespace before the value is left out: clients parse each prefix, and one of
        # whitespace alone is no JSON they can read
        pieces = function.get("arguments") or ""
        pieces = pieces if self.json_begun else pieces.lstrip()
        if pieces:
            self.json_begun = True
            out.append(self.event("content_block_delta", index=self.index,
                                  delta={"type": "input_json_delta", "partial_json": pieces}))
        return out

    def _open(self, kind: str, shell: dict[str, Any]) -> list[str]:
        out = self._close()
        self.index += 1
        self.open, self.json_begun = kind, False
        return [*out, self.event("content_block_start", index=self.index, content_block=shell)]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [self.event("content_block_stop", index=self.index)]

    def end(self, final: dict[str, Any]) -> list[str]:
        delta = {"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]}
        return [*self._close(), self.event("message_delta", delta=delta, usage=final["usage"]),
                self.event("message_stop")]


ERROR_TYPES = {"timeout_error": "timeout_error", "invalid_request_error": "invalid_request_error"}


async def stream(
    state: AppState, request: MessagesRequest, req: RelayedRequest
) -> AsyncGenerator[str, None]:
    """The Messages stream: message_start once the worker has counted the prompt, the content
    blocks as they come, message_delta (stop reason, usage) and message_stop; a failure is an
    `error` event."""
    renderer, collector = MessageRenderer(), Collector(req)
    events = MessageEvents(req)
    started = False
    async with aclosing(relayed_chunks(state, req, renderer, collector)) as chunks:
        async for chunk in chunks:
            if not started:
                started = True
                yield events.start(sum(collector.prompt_tokens.values()) - sum(collector.cached_tokens.values()))
            if isinstance(chunk, StreamError):
                error = {"type": ERROR_TYPES.get(chunk.type, "api_error"), "message": chunk.message}
                yield events.event("error", error=error)
                return
            choice = chunk["choices"][0] if chunk else {}
            for line in events.delta(choice.get("delta", {})):
                yield line
    if not started:
        yield events.start(0)
    final = message_object(request, renderer.response(req, collector.choices, collector.usage()))
    for line in events.end(final):
        yield line
