"""OpenAI's response shapes, built from genq events: non-streaming responses and stream
chunks (their logprobs: api.logprobs). Plain functions of plain data; no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from api.logprobs import (
    TokenLogprob,
    chat_logprobs,
    completion_logprobs,
    event_logprobs,
    vllm_prompt_logprobs,
)
from api.parsers.call_stream import CallDelta, ToolCall
from api.parsers.reasoning import reader as reasoning_reader
from api.parsers.reasoning import split
from api.parsers.text_readers import PairReader, read_piece
from api.parsers.tool_calls import Reader, calls_reader, read_all
from api.response_bodies import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    Usage,
)
from producer.protocol import Event


@dataclass(frozen=True)
class RelayedRequest:
    """One HTTP request relayed as jobs: choice `i * n + j` is completion `j` of job `i`."""

    id: str  # the response id, e.g. "chatcmpl-<job id>"
    job_ids: list[str]
    n: int
    model: str
    created: int  # unix seconds
    include_usage: bool = False
    continuous_usage: bool = False  # each chunk's usage: its choice's so far (vLLM's continuous_usage_stats)
    num_logprobs: int | None = None  # alternatives per token; None: no logprobs
    enqueued: bool = True  # False: every job id existed already (idempotent submit)
    # completions' `echo`, per job: the prompt text to put before each of its completions
    # (None: the prompt as the worker decoded it, for token ids); empty: no echo
    echo: tuple[str | None, ...] = ()
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs asked for (non-streaming responses)
    tool_call: str | None = None  # chat's forced tool call: each choice's text is its arguments
    read_tool_calls: str | None = None  # the form each choice's text holds calls in (READERS)
    # (tool, parameter) for each parameter the tools declare a string: GLM's calls write its
    # values as raw text, any other value as JSON (api.parsers.glm_tool_calls)
    string_parameters: tuple[tuple[str, str], ...] = ()
    parallel_tool_calls: bool = True  # False: a choice keeps only its first call
    reasoning_parser: str | None = None  # chat: split the thinking off (api.parsers.reasoning)
    include_reasoning: bool = True  # vLLM's: False leaves the thinking out of the reply
    chat_echo: str | None = None  # chat's `echo`: the last assistant message, which each reply begins with
    return_token_ids: bool = False  # vLLM's: each choice's token ids, and the prompt's, beside the text
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    service_tier: str = "default"  # the tier its jobs run on (request_bodies.service_tier_of), set when submitted
    # the field that asked for guided decoding: a job the worker refuses for its guide (which
    # xgrammar compiles there, not here) fails naming it
    guide_param: str | None = None

    def tool_call_id(self, choice: Choice, k: int = 0) -> str:
        """The id of call `k` of a choice."""
        suffix = f"_{k}" if k else ""
        return f"call_{self.id.rsplit('-', 1)[-1][:24]}_{choice.index}{suffix}"

    @property
    def logprobs(self) -> bool:
        return self.num_logprobs is not None

    def choice_index(self, job_id: str, event: Event) -> int:
        return self.job_ids.index(job_id) * self.n + event.index

    @property
    def num_choices(self) -> int:
        return len(self.job_ids) * self.n


@dataclass
class Choice:
    """One completion as it accumulates; with echo, its text and logprobs begin with the
    prompt's."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # generated tokens only
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)  # completions' `text_offset`
    _spelled: int = 0  # characters of the tokens so far, each decoded alone
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[Any] | None = None  # the job's, as the worker sent them
    prompt_tokens: int | None = None  # the job's, once the worker has counted them
    num_events: int = 0
    # where the text and logprobs the last event brought begin (the echo counts with the
    # first event): what its stream chunk carries
    last_text_start: int = 0
    last_logprobs_start: int = 0
    tool_calls: Reader | None = None  # what read the streamed text for calls
    reasoning: PairReader | None = None  # what split the streamed text's thinking off
    content_sent: bool = False  # a stream chunk has carried some of its content
    embedding: bytes | None = None  # an embedding job's vector (float32, little-endian)
    token_timestamps: list[float] | None = None  # Whisper's, asked for: each token's time in the audio
    prompt_token_ids: list[int] | None = None  # the job's, when the request asked for them
    ids_sent: int = 0  # token ids the stream's chunks have carried (return_token_ids)
    prompt_ids_sent: bool = False

    def echo(self, text: str, logprobs: list[TokenLogprob]) -> None:
        """Put the prompt first; before the first event."""
        assert self.num_events == 0, "the echo goes before the completion"
        self.text, self.logprobs = text, list(logprobs)
        self._add_offsets(0, logprobs)

    def add(self, event: Event) -> None:
        start = len(self.text)
        self.last_text_start = start if self.num_events else 0
        self.last_logprobs_start = len(self.logprobs) if self.num_events else 0
        self.num_events += 1
        self.text += event.text
        self.token_ids += event.token_ids
        new = event_logprobs(event)
        self.logprobs += new
        self._add_offsets(start, new)
        if event.finished:
            self.finish_reason, self.stop_reason = event.finish_reason, event.stop_reason
        if event.embedding is not None:
            self.embedding = event.embedding
        if event.token_timestamps is not None:
            self.token_timestamps = event.token_timestamps
        if event.prompt_token_ids is not None:
            self.prompt_token_ids = event.prompt_token_ids

    def unsent_ids(self) -> dict[str, Any]:
        """A stream chunk's token ids (vLLM's return_token_ids): those generated since the
        last chunk, and with the first, the prompt's."""
        out: dict[str, Any] = {"token_ids": self.token_ids[self.ids_sent:]}
        self.ids_sent = len(self.token_ids)
        if not self.prompt_ids_sent and self.prompt_token_ids is not None:
            out["prompt_token_ids"], self.prompt_ids_sent = self.prompt_token_ids, True
        return out

    def _add_offsets(self, start: int, new: list[TokenLogprob]) -> None:
        """OpenAI's `text_offset`: where each token begins in the text, by the lengths of the
        tokens before it as decoded alone (as vLLM counts), never before the text the earlier
        events added (tokens without a spelling) nor past the text so far (the detokenizer
        holds back the bytes of a character it has not seen whole)."""
        self._spelled = max(self._spelled, start)
        for lp in new:
            self.text_offsets.append(min(self._spelled, len(self.text)))
            self._spelled += len(lp.spelled)


# ---------------------------------------------------------------------------------------------
# Renderers: one per endpoint


class Renderer(Protocol):
    object_name: str  # of stream chunks
    id_prefix: str  # of response ids

    def preamble(self, req: RelayedRequest) -> list[dict[str, Any]]: ...

    def chunk(self, req: RelayedRequest, choice: Choice, event: Event) -> dict[str, Any] | None: ...

    def response(self, req: RelayedRequest, choices: list[Choice], usage: Usage) -> Any: ...


def _chunk_envelope(req: RelayedRequest, object_name: str, choices: list[Any],
                    choice: Choice | None = None) -> dict[str, Any]:
    """A stream chunk; with include_usage its `usage` is null (OpenAI: every chunk's but the
    last), or with continuous usage `choice`'s so far, once the worker has counted the prompt
    (vLLM's continuous_usage_stats)."""
    chunk: dict[str, Any] = {
        "id": req.id, "object": object_name, "created": req.created, "model": req.model,
        "choices": choices, "service_tier": req.service_tier,
    }
    if req.include_usage:
        chunk["usage"] = None
        if req.continuous_usage and choice is not None and choice.prompt_tokens is not None:
            completion = len(choice.token_ids)
            chunk["usage"] = {"prompt_tokens": choice.prompt_tokens, "completion_tokens": completion,
                              "total_tokens": choice.prompt_tokens + completion}
    return chunk


def usage_chunk(req: RelayedRequest, object_name: str, usage: Usage) -> dict[str, Any]:
    return {**_chunk_envelope(req, object_name, []), "usage": usage.model_dump()}


def _has_news(event: Event) -> bool:
    return bool(event.text) or event.finished or bool(event.logprobs)


class CompletionRenderer:
    """`text_completion` responses and chunks."""

    object_name = "text_completion"
    id_prefix = "cmpl-"

    def preamble(self, req: RelayedRequest) -> list[dict[str, Any]]:
        return []

    def chunk(self, req: RelayedRequest, choice: Choice, event: Event) -> dict[str, Any] | None:
        if not _has_news(event) and choice.last_text_start == len(choice.text):
            return None
        start = choice.last_logprobs_start
        new, offsets = choice.logprobs[start:], choice.text_offsets[start:]
        body = {
            "index": choice.index, "text": choice.text[choice.last_text_start:],
            "logprobs": (
                completion_logprobs(_named(req, new), offsets, req.num_logprobs) if req.logprobs else None
            ),
            "finish_reason": event.finish_reason if event.finished else None,
            "stop_reason": event.stop_reason if event.finished else None,
            **(choice.unsent_ids() if req.return_token_ids else {}),
        }
        return _chunk_envelope(req, self.object_name, [body], choice)

    def response(
        self, req: RelayedRequest, choices: list[Choice], usage: Usage
    ) -> CompletionResponse:
        return CompletionResponse(
            id=req.id, created=req.created, model=req.model, usage=usage, service_tier=req.service_tier,
            choices=[
                CompletionChoice(
                    index=c.index, text=c.text, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=(
                        completion_logprobs(_named(req, c.logprobs), c.text_offsets, req.num_logprobs)
                        if req.logprobs else None
                    ),
                    prompt_logprobs=(
                        vllm_prompt_logprobs(c.prompt_logprobs) if req.prompt_logprobs else None
                    ),
                    token_ids=c.token_ids if req.return_token_ids else None,
                    prompt_token_ids=c.prompt_token_ids if req.return_token_ids else None,
                )
                for c in choices
            ],
        )


class ChatRenderer:
    """`chat.completion` responses and `chat.completion.chunk` chunks."""

    object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def preamble(self, req: RelayedRequest) -> list[dict[str, Any]]:
        """First chunk of each choice: the role, as OpenAI sends it (with chat's echo, then
        the echoed message, as vLLM sends it)."""
        openings = [{"role": "assistant", "content": ""}] + ([{"content": req.chat_echo}] if req.chat_echo else [])
        return [
            _chunk_envelope(req, self.object_name, [{
                "index": i, "delta": delta, "logprobs": None, "finish_reason": None,
            }])
            for i in range(req.num_choices)
            for delta in openings
        ]

    def chunk(self, req: RelayedRequest, choice: Choice, event: Event) -> dict[str, Any] | None:
        if not _has_news(event):
            return None
        reasoning, text = _split_reasoning(req, choice, event)
        if req.read_tool_calls:
            delta = _read_delta(req, choice, text, event.finished)
        else:
            delta = _delta(req, choice, text)
        if reasoning and req.include_reasoning:  # (vLLM's current name, and its older one)
            delta = {"reasoning": reasoning, "reasoning_content": reasoning, **delta}
        if not delta and not event.finished and not event.logprobs:
            return None  # held back: it may be part of a tag or a call
        finish_reason = event.finish_reason if event.finished else None
        body = {
            "index": choice.index,
            "delta": delta,
            "logprobs": (
                chat_logprobs(_named(req, event_logprobs(event)), req.num_logprobs) if req.logprobs else None
            ),
            "finish_reason": _called(choice.tool_calls.num_calls if choice.tool_calls else 0, finish_reason),
        }
        chunk = _chunk_envelope(req, self.object_name, [body], choice)
        if req.return_token_ids:  # (vLLM's chat chunks hold the prompt's beside the choices)
            ids = choice.unsent_ids()
            body["token_ids"] = ids["token_ids"]
            if "prompt_token_ids" in ids:
                chunk["prompt_token_ids"] = ids["prompt_token_ids"]
        return chunk

    def response(
        self, req: RelayedRequest, choices: list[Choice], usage: Usage
    ) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=req.id, created=req.created, model=req.model, usage=usage, service_tier=req.service_tier,
            choices=[
                ChatChoice(
                    index=c.index, message=message,
                    finish_reason=_called(
                        len(message.tool_calls or []) if req.read_tool_calls else 0, c.finish_reason
                    ),
                    stop_reason=c.stop_reason,
                    logprobs=chat_logprobs(_named(req, c.logprobs), req.num_logprobs) if req.logprobs else None,
                    token_ids=c.token_ids if req.return_token_ids else None,
                )
                for c in choices
                for message in [_message(req, c)]
            ],
            prompt_logprobs=(
                vllm_prompt_logprobs(choices[0].prompt_logprobs) if req.prompt_logprobs else None
            ),
            prompt_token_ids=choices[0].prompt_token_ids if req.return_token_ids else None,
        )


def _named(req: RelayedRequest, logprobs: list[TokenLogprob]) -> list[TokenLogprob]:
    """Logprobs' tokens by their text, or by "token_id:<id>" as the request asks."""
    return [lp.as_token_ids() for lp in logprobs] if req.tokens_as_ids else logprobs


def _message(req: RelayedRequest, choice: Choice) -> AssistantMessage:
    reasoning, text = (
        split(choice.text, req.reasoning_parser) if req.reasoning_parser else (None, choice.text)
    )
    if not req.include_reasoning:
        reasoning = None
    if req.read_tool_calls:
        content, calls = read_all(text, req.read_tool_calls, req.string_parameters)
        if req.chat_echo:  # (streamed first, before any call is read)
            content = req.chat_echo + (content or "")
        calls = _kept(req, calls)
        listed = [_call(req, choice, k, call) for k, call in enumerate(calls)]
        return AssistantMessage(content=content, tool_calls=listed or None, reasoning_content=reasoning)
    if req.tool_call is None:
        return AssistantMessage(content=(req.chat_echo or "") + text, reasoning_content=reasoning)
    call = {"id": req.tool_call_id(choice), "type": "function",
            "function": {"name": req.tool_call, "arguments": text.lstrip()}}
    return AssistantMessage(content=None, tool_calls=[call], reasoning_content=reasoning)


def _delta(req: RelayedRequest, choice: Choice, text: str) -> dict[str, Any]:
    """A chunk's delta: content, or with a forced tool call its arguments (the first piece
    also names the call, as OpenAI streams it; whitespace the guide let the model write before
    the arguments' brace is none of them)."""
    if req.tool_call is not None and not choice.content_sent:
        text = text.lstrip()
    if not text:
        return {}
    first, choice.content_sent = not choice.content_sent, True
    if req.tool_call is None:
        return {"content": text}
    return {"tool_calls": [_piece(req, choice, CallDelta(0, req.tool_call if first else None, text))]}


def _split_reasoning(req: RelayedRequest, choice: Choice, event: Event) -> tuple[str, str]:
    """The reasoning and the rest that an event's text brought (no reasoning without a
    reasoning parser)."""
    if req.reasoning_parser is None:
        return "", event.text
    reader = choice.reasoning = choice.reasoning or reasoning_reader(req.reasoning_parser)
    return read_piece(reader, event.text, event.finished)


def _read_delta(req: RelayedRequest, choice: Choice, text: str, finished: bool) -> dict[str, Any]:
    """The content the text brought, and the pieces of calls: a call's first piece has its
    id and name, each piece some of its arguments (as OpenAI streams them)."""
    assert req.read_tool_calls is not None
    reader = choice.tool_calls = choice.tool_calls or calls_reader(req.read_tool_calls, req.string_parameters)
    content, deltas = read_piece(reader, text, finished)
    delta: dict[str, Any] = {"content": content} if content else {}
    pieces = [_piece(req, choice, d) for d in deltas if req.parallel_tool_calls or d.index == 0]
    if pieces:
        delta["tool_calls"] = pieces
    return delta


def _piece(req: RelayedRequest, choice: Choice, delta: CallDelta) -> dict[str, Any]:
    if delta.name is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    return {"index": delta.index, **_call(req, choice, delta.index, ToolCall(delta.name, delta.arguments))}


def _kept(req: RelayedRequest, calls: list[ToolCall]) -> list[ToolCall]:
    """Without parallel_tool_calls a choice keeps only its first call."""
    return calls if req.parallel_tool_calls else calls[:1]


def _call(req: RelayedRequest, choice: Choice, k: int, call: ToolCall) -> dict[str, Any]:
    return {"id": req.tool_call_id(choice, k), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _called(num_calls: int, finish_reason: str | None) -> str | None:
    """A reply read for calls that ended by itself after calling tools finishes with
    "tool_calls", as OpenAI's do (a forced call keeps "stop", as OpenAI's does)."""
    if finish_reason == "stop" and num_calls:
        return "tool_calls"
    return finish_reason
