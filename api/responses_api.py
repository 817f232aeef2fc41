"""OpenAI's Responses API (`POST /v1/responses`) on top of chat: a request is translated into a
chat completion request, run as one job like any other, and its reply rendered as a response
object (output items: reasoning, a message, function calls) or as the Responses stream events.

What is supported: `input` as text or items (messages with text and image parts, `function_call` and
`function_call_output` items, so an agent loop can send tool results back), a stored
response to continue (`previous_response_id`; api.stored_responses), `instructions`,
`max_output_tokens`, `temperature`, `top_p`, function `tools` with `tool_choice` and
`parallel_tool_calls`, `text.format` (text, json_object, json_schema), `stream`, and chat's
sampling extras (`seed`, `top_k`, `stop`, `ignore_eos`, ...), output-text logprobs (`include`,
`top_logprobs`), and `background` (polled; api.background_responses). Non-function tools are
a 400 naming the field.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from api import conversations, stored_responses
from api.conversations import conversation_id, request_items
from api.deps import AppState
from api.errors import invalid_param
from api.generate import Collector, StreamError, relayed_chunks
from api.render import ChatRenderer, RelayedRequest
from api.request_bodies import ChatCompletionRequest
from api.response_bodies import ChatCompletionResponse


class ResponsesRequest(BaseModel):
    # other fields are kept: chat's sampling extras (seed, top_k, stop, ignore_eos, ...) pass on
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None  # a stored response this one continues
    # a conversation (api.conversations) this one runs on and adds its turn to: its id or {"id": ...}
    conversation: str | dict[str, Any] | None = None
    store: bool = True  # keep it (GENQ_FILE_TTL_S) for retrieval and previous_response_id
    background: bool = False  # answer at once (queued); poll GET /v1/responses/{id} (api.background_responses)
    include: list[str] | None = None  # "message.output_text.logprobs": each output token's logprob
    top_logprobs: int | None = None  # with those logprobs, this many alternatives per token
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": "low" | "medium" | "high"}: chat's reasoning_effort


class ResponseRenderer(ChatRenderer):
    """Chat's renderer with the Responses API's id prefix."""

    id_prefix = "resp_"


# ---------------------------------------------------------------------------------------------
# Request: Responses -> chat


def to_chat(request: ResponsesRequest, history: list[dict[str, Any]] | None = None) -> ChatCompletionRequest:
    """The chat request that does what `request` asks, after `history` (the conversation of
    its previous response, as chat messages); APIError naming the field otherwise."""
    if request.previous_response_id is not None and history is None:
        raise invalid_param("previous_response_id", "previous_response_id is not supported here: send the whole conversation in input")
    messages = [{"role": "system", "content": request.instructions}] if request.instructions else []
    messages += history or []
    if not request.input:  # ("" too: a reply to nothing would run on to max_model_len)
        raise invalid_param("input", "input must be non-empty text or a non-empty list of items")
    items = [{"role": "user", "content": request.input}] if isinstance(request.input, str) else request.input
    messages += as_messages(items, "input")
    passed_on = set(ChatCompletionRequest.model_fields) - CHAT_ONLY
    body: dict[str, Any] = {
        **{k: v for k, v in (request.model_extra or {}).items() if k in passed_on},
        "model": request.model, "messages": messages, "max_tokens": request.max_output_tokens,
        "parallel_tool_calls": request.parallel_tool_calls,
        **{k: v for k, v in (("temperature", request.temperature), ("top_p", request.top_p)) if v is not None},
    }
    if _wants_logprobs(request):
        body["logprobs"], body["top_logprobs"] = True, request.top_logprobs or 0
    effort = (request.reasoning or {}).get("effort")
    if effort is not None:
        body["reasoning_effort"] = effort
    if request.tools:
        body["tools"] = [_chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(request.tools)]
    if request.tool_choice is not None:
        choice = request.tool_choice
        body["tool_choice"] = (
            {"type": "function", "function": {"name": choice.get("name")}} if isinstance(choice, dict) else choice
        )
    fmt = (request.text or {}).get("format") or {"type": "text"}
    if fmt.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt.get("type") == "json_schema":
        spec = {k: fmt.get(k) for k in ("name", "schema", "strict") if k in fmt}
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif fmt.get("type") != "text":
        raise invalid_param("text.format", f"text.format type must be text, json_object or json_schema, got {fmt.get('type')!r}")
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise invalid_param(".".join(str(p) for p in first["loc"]), first["msg"]) from None


LOGPROBS = "message.output_text.logprobs"
# reasoning items carry their text as `encrypted_content`, for clients that keep no state
# (store false) and send the items back (Codex): genq's thinking is no secret, only encoded
ENCRYPTED_REASONING = "reasoning.encrypted_content"
INCLUDABLE = (LOGPROBS, ENCRYPTED_REASONING)


def _wants_logprobs(request: ResponsesRequest) -> bool:
    unknown = [value for value in request.include or [] if value not in INCLUDABLE]
    if unknown:
        raise invalid_param("include", f"include {unknown[0]!r} is not supported (only {' and '.join(INCLUDABLE)})")
    return LOGPROBS in (request.include or [])


def _encrypted(request: ResponsesRequest) -> bool:
    return ENCRYPTED_REASONING in (request.include or [])


# chat fields a Responses request sets through its own, or that have no meaning here
CHAT_ONLY = {
    "background", "messages", "max_tokens", "max_completion_tokens", "tools", "tool_choice", "response_format",
    "stream", "stream_options", "n", "logprobs", "top_logprobs", "echo", "prompt_logprobs",
}
# chat fields a 400 may name, as a Responses request names them
PARAMS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}


def as_messages(items: list[Any], where: str) -> list[dict[str, Any]]:
    """Responses items as chat messages; APIError naming `where[i]` for one chat cannot take."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        _add_item(messages, item, f"{where}[{i}]")
    return messages


def _add_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise invalid_param(where, "an input item must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        role = "system" if role == "developer" else role  # OpenAI's newer name for it
        messages.append({"role": role, "content": _text(item.get("content"), where)})
    elif kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
            last["tool_calls"].append(call)  # parallel calls: one assistant turn
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "reasoning":
        return  # an earlier turn's thinking: chat templates leave it out of the prompt too
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": output if isinstance(output, str) else json.dumps(output)})
    else:
        raise invalid_param(f"{where}.type", f"input items of type {kind!r} are not supported "
                            "(message, function_call, function_call_output, reasoning)")


def _text(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content as chat takes it: its text, or with images or audio its parts."""
    if isinstance(content, str):
        return content
    kinds = {"input_text", "output_text", "text", "input_image", "input_audio"}
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in kinds for p in content):
        if all(p["type"] not in ("input_image", "input_audio") for p in content):
            return "".join(p.get("text") or "" for p in content)
        return [_media_part(p) for p in content]
    raise invalid_param(f"{where}.content", "only text, image and audio content (input_text, output_text, "
                        "input_image, input_audio) is supported")


def _media_part(part: dict[str, Any]) -> dict[str, Any]:
    """A Responses content part as chat's: input_image -> image_url; input_audio is chat's own."""
    if part["type"] == "input_image":
        return {"type": "image_url", "image_url": {"url": part.get("image_url")}}
    if part["type"] == "input_audio":
        return {"type": "input_audio", "input_audio": part.get("input_audio")}
    return {"type": "text", "text": part.get("text") or ""}


def _chat_tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise invalid_param(f"{where}.type", "only function tools are supported")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


# ---------------------------------------------------------------------------------------------
# Response: chat -> Responses


def response_object(
    request: ResponsesRequest, chat: ChatCompletionResponse, status: str | None = None
) -> dict[str, Any]:
    """The response for a finished chat completion (its one choice)."""
    choice = chat.choices[0]
    base = chat.id.removeprefix(ResponseRenderer.id_prefix)
    message = choice.message
    incomplete = choice.finish_reason == "length"
    output: list[dict[str, Any]] = []
    if message.reasoning_content:
        output.append(reasoning_item(base, message.reasoning_content, _encrypted(request)))
    if message.content:
        logprobs = (choice.logprobs or {}).get("content")
        output.append(message_item(base, message.content, "incomplete" if incomplete else "completed", logprobs))
    for k, call in enumerate(message.tool_calls or []):
        function = call["function"]
        output.append(function_call_item(base, k, call["id"], function["name"], function["arguments"]))
    usage = chat.usage
    return {
        **envelope(request, chat.id, chat.created, chat.model, chat.service_tier),
        "status": status or ("incomplete" if incomplete else "completed"),
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "output": output,
        "usage": {
            "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "input_tokens_details": {
                "cached_tokens": usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
            },
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }


def envelope(request: ResponsesRequest, response_id: str, created: int, model: str,
             service_tier: str | None = None) -> dict[str, Any]:
    """The response's fields that echo the request (and `service_tier`: the tier it runs on)."""
    return {
        "id": response_id, "object": "response", "created_at": created, "model": model,
        "service_tier": service_tier or "default",
        "error": None, "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata or {}, "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id, "store": request.store,
        "conversation": {"id": conversation_id(request.conversation)} if request.conversation else None,
        "background": request.background, "top_logprobs": request.top_logprobs,
        "temperature": request.temperature,
        "text": request.text or {"format": {"type": "text"}}, "tool_choice": request.tool_choice or "auto",
        "tools": request.tools or [], "top_p": request.top_p,
    }


def message_item(base: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{base}", "status": status, "role": "assistant",
            "content": [_text_part(text, logprobs)]}


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An output_text part; `logprobs` in chat's per-token form, which is the Responses one."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def reasoning_item(base: str, text: str, encrypted: bool = False) -> dict[str, Any]:
    item = {"type": "reasoning", "id": f"rs_{base}", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}
    return {**item, "encrypted_content": base64.b64encode(text.encode()).decode()} if encrypted else item


def function_call_item(base: str, k: int, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{base}_{k}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


# ---------------------------------------------------------------------------------------------
# Streaming: the chat renderer's deltas as Responses events


class ResponseEvents:
    """Turns one choice's chat deltas into Responses stream events, opening and closing output
    items (reasoning, message, function calls) as the kind of delta changes."""

    def __init__(self, request: ResponsesRequest, req: RelayedRequest, starting_after: int = -1) -> None:
        self.request, self.req = request, req
        self.base = req.id.removeprefix(ResponseRenderer.id_prefix)
        self.sequence = 0
        self.starting_after = starting_after  # events up to this sequence number were sent before
        self.items: list[dict[str, Any]] = []  # output items so far; the last may be open
        self.open: str | None = None  # kind of the open item
        self.text = ""  # of the open item
        self.logprobs: list[dict[str, Any]] = []  # of the open message item's text

    def event(self, kind: str, **fields: Any) -> str:
        """The SSE lines of one event; "" for one the client had (a resumed stream)."""
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        if body["sequence_number"] <= self.starting_after:
            return ""
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"

    def start(self) -> list[str]:
        shell = {**envelope(self.request, self.req.id, self.req.created, self.req.model, self.req.service_tier),
                 "status": "in_progress", "output": [], "incomplete_details": None, "usage": None}
        return [self.event("response.created", response=shell), self.event("response.in_progress", response=shell)]

    def delta(self, delta: dict[str, Any], logprobs: list[dict[str, Any]] | None = None) -> list[str]:
        """Events for one chat delta; `logprobs` (chat's per-token form) go with its text."""
        out: list[str] = []
        calls = delta.get("tool_calls") or []
        if delta.get("reasoning_content"):
            out += self._text("reasoning", delta["reasoning_content"])
        for call in calls:  # the open call's further arguments were written before any content
            out += self._call(call) if not call.get("id") else []
        if delta.get("content"):
            out += self._text("message", delta["content"], logprobs)
        for call in calls:
            out += self._call(call) if call.get("id") else []
        return out

    def _text(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[str]:
        out = self._switch(kind)
        index, item_id = len(self.items) - 1, self.items[-1]["id"]
        self.text += text
        if kind == "message":
            self.logprobs += logprobs or []
            return [*out, self.event("response.output_text.delta", item_id=item_id, output_index=index,
                                     content_index=0, delta=text, logprobs=logprobs or [])]
        return [*out, self.event("response.reasoning_text.delta", item_id=item_id, output_index=index,
                                 content_index=0, delta=text)]

    def _call(self, call: dict[str, Any]) -> list[str]:
        """A call's first piece (it has the id) opens an item; later pieces add to its
        arguments."""
        out: list[str] = []
        function = call.get("function") or {}
        if call.get("id"):
            out += self._close()
            k = sum(item["type"] == "function_call" for item in self.items)
            item = function_call_item(self.base, k, call["id"], function.get("name", ""), "", "in_progress")
            self.items.append(item)
            self.open, self.text = "function_call", ""
            out.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=item))
        pieces = function.get("arguments") or ""
        if pieces:
            self.text += pieces
            out.append(self.event("response.function_call_arguments.delta", item_id=self.items[-1]["id"],
                                  output_index=len(self.items) - 1, delta=pieces))
        return out

    def _switch(self, kind: str) -> list[str]:
        if self.open == kind:
            return []
        out = self._close()
        item = reasoning_item(self.base, "") if kind == "reasoning" else message_item(self.base, "", "in_progress")
        item["content"] = []
        self.items.append(item)
        self.open, self.text, self.logprobs = kind, "", []
        index = len(self.items) - 1
        out.append(self.event("response.output_item.added", output_index=index, item=item))
        if kind == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=_text_part("")))
        return out

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        item, index, text = self.items[-1], len(self.items) - 1, self.text
        out = []
        if self.open == "message":
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                  text=text, logprobs=self.logprobs))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=_text_part(text, self.logprobs)))
            item.update(message_item(self.base, text, "completed", self.logprobs))
        elif self.open == "reasoning":
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0, text=text))
            item.update(reasoning_item(self.base, text, _encrypted(self.request)))
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments=text))
            item.update(arguments=text, status="completed")
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        self.open = None
        return out

    def end(self, final: dict[str, Any]) -> list[str]:
        name = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return [*self._close(), self.event(name, response=final)]

    def failed(self, message: str, code: str) -> list[str]:
        shell = {**envelope(self.request, self.req.id, self.req.created, self.req.model, self.req.service_tier), "status": "failed",
                 "output": self.items, "incomplete_details": None, "usage": None,
                 "error": {"code": code, "message": message}}
        return [self.event("error", code=code, message=message, param=None), self.event("response.failed", response=shell)]


async def stream(
    state: AppState, request: ResponsesRequest, req: RelayedRequest, chat_request: ChatCompletionRequest,
    starting_after: int = -1, stored: dict[str, Any] | None = None,
) -> AsyncGenerator[str, None]:
    """The Responses stream: created, the output items as they come, completed (or failed);
    the finished response is stored as `finish` stores it. A background response's stream
    (`stored`: what its record keeps) leaves the job running when the client goes, and may
    resume after the event numbered `starting_after` (the events are replayed from Redis)."""
    renderer, collector = ResponseRenderer(), Collector(req)
    events = ResponseEvents(request, req, starting_after)
    for line in filter(None, events.start()):
        yield line
    async with aclosing(relayed_chunks(state, req, renderer, collector, keep_jobs=stored is not None)) as chunks:
        async for chunk in chunks:
            if isinstance(chunk, StreamError):
                if stored is not None and chunk.code == "timeout":  # the job runs on: say where to resume
                    message = (f"{chunk.message}; the response is still running: GET /v1/responses/{req.id}"
                               f"?stream=true&starting_after={events.sequence - 1} resumes it")
                    yield events.event("error", code=chunk.code, message=message, param=None)
                    return
                for line in filter(None, events.failed(chunk.message, chunk.code)):
                    yield line
                return
            choice = chunk["choices"][0] if chunk else {}
            for line in filter(None, events.delta(choice.get("delta", {}), (choice.get("logprobs") or {}).get("content"))):
                yield line
    response = renderer.response(req, collector.choices, collector.usage())
    final = await finish(state, request, chat_request, response, stored)
    for line in filter(None, events.end(final)):
        yield line


async def finish(
    state: AppState, request: ResponsesRequest, chat_request: ChatCompletionRequest, chat: ChatCompletionResponse,
    background: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The response object of a finished chat completion, stored unless `store` is false (a
    background one with what replaying its stream needs)."""
    final = response_object(request, chat)
    given = request_items(request.input)
    if request.store:
        await stored_responses.save(state, final, chat_request, instructions=bool(request.instructions),
                                    input_items=given, background=background)
    conv_id = conversation_id(request.conversation)
    if conv_id is not None:  # its turn: what it was given, then what it gave
        await conversations.add_turn(state, conv_id, final["id"], given + final["output"])
    return final
