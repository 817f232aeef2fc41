"""Request bodies, in OpenAI's shapes (plus vLLM's sampling extras); responses: api.response_bodies.

Requests only check types here; value ranges are checked once, by `SamplingParams`, whose
ValueError names the field (the routes turn it into a 400 with that `param`).
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag

from api.parsers.tool_calls import calls_schema
from producer.protocol import MAX_PROMPT_CACHE_KEY_LEN
from producer.sampling_params import SamplingParams

PromptInput = str | dict[str, Any] | list[dict[str, Any]]  # as `AsyncClient.submit` takes it


# OpenAI's service_tier as a priority (lower runs first), as vLLM maps it: its sign picks the
# job's priority lane (docs/queue.md). An explicit `priority` takes precedence.
SERVICE_TIER_PRIORITY = {"auto": 0, "default": 0, "flex": 2, "scale": -1, "priority": -2}
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]


def service_tier_of(priority: int) -> str:
    """The tier a job of this priority runs on, as responses report it: its lane's."""
    return "priority" if priority < 0 else "flex" if priority > 0 else "default"


class StreamOptions(BaseModel):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk of a choice carries its usage so far
    continuous_usage_stats: bool = False


class _GenerationRequest(BaseModel):
    """Fields shared by completions and chat: OpenAI's sampling fields and vLLM's extras."""

    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use

    model: str | None = None
    n: int = 1
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (a string in JSON) -> bias
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0  # lower runs first, as in vLLM
    service_tier: ServiceTier | None = None  # OpenAI's: flex runs after, priority before (SERVICE_TIER_PRIORITY)
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: as many as fit)
    bad_words: list[str] | None = None  # words the output may not contain
    # vLLM's: a reasoning model thinks at most this many tokens, then its thinking is ended for it
    thinking_token_budget: int | None = None
    use_beam_search: bool = False  # vLLM's: the n best of an n-wide beam search (api.beam_search)
    length_penalty: float = 1.0  # beam search ranks by logprob / length ** length_penalty
    prompt_logprobs: int | None = None  # each prompt token's logprob, with this many alternatives
    guided_choice: list[str] | None = None  # the output is exactly one of these
    guided_json: dict[str, Any] | str | None = None  # vLLM's: a JSON schema the output follows
    guided_regex: str | None = None  # vLLM's: a regular expression the whole output matches
    guided_grammar: str | None = None  # vLLM's: an EBNF grammar the output is a sentence of
    # vLLM's current form of the guided_* fields: {"json" | "regex" | "choice" | "grammar" |
    # "json_object": ...} (producer.sampling_params.StructuredOutputsParams)
    structured_outputs: dict[str, Any] | None = None
    # {"type": "json_object"}: one JSON object; {"type": "json_schema", "json_schema": {"name",
    # "schema"}}: a value of that schema; vLLM's {"type": "structural_tag", "structures": [...],
    # "triggers": [...]} (producer.grammar.structural_tag); {"type": "text"} or absent: free text
    response_format: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None  # vLLM's: settings for the workers' custom logits processors
    # vLLM's: the workers' prefix cache shares this request's blocks only with requests of the
    # same salt (a secret per tenant: no one else can learn its prompts by how fast they run)
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # OpenAI's: requests of one key go to the worker whose prefix cache ran the last one (while
    # it has room); without it, requests whose prompts start alike do (worker.queue.affinity)
    prompt_cache_key: Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CACHE_KEY_LEN)] | None = None
    # vLLM's: token ids beside the text (each choice's generated ones, and the prompt's as the
    # worker ran it); logprobs' tokens as "token_id:<id>" rather than their text
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # genq's: max_tokens is cut to the room the prompt leaves, not refused with a 400 (vLLM's rule)
    clamp_max_tokens: bool = False

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_priority(self) -> int:
        """The priority asked for: `priority` where given, else the service_tier's."""
        if "priority" in self.model_fields_set:
            return self.priority
        return SERVICE_TIER_PRIORITY[self.service_tier or "auto"]

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats

    def _common_params(self, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
        """`defaults`: the model's values for the sampling fields the request leaves unset
        (its generation_config.json's, as the workers report them); else SamplingParams'."""
        optional = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
        }
        optional = {k: (defaults or {}).get(k) if v is None else v for k, v in optional.items()}
        return {
            "n": self.n, "seed": self.seed, "stop": self.stop or [],
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos, "stop_token_ids": self.stop_token_ids or [],
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "logit_bias": self.logit_bias or None, "allowed_token_ids": self.allowed_token_ids,
            **self._guided_params(),
            "truncate_prompt_tokens": self.truncate_prompt_tokens, "bad_words": self.bad_words,
            "extra_args": self.vllm_xargs, "thinking_token_budget": self.thinking_token_budget,
            "clamp_max_tokens": self.clamp_max_tokens,
            **{k: v for k, v in optional.items() if v is not None},
        }

    def _guided_fields(self) -> list[tuple[str, bool]]:
        return [
            ("response_format", (self.response_format or {}).get("type", "text") != "text"),
            ("guided_json", self.guided_json is not None),
            ("guided_choice", self.guided_choice is not None),
            ("guided_regex", self.guided_regex is not None),
            ("guided_grammar", self.guided_grammar is not None),
            ("structured_outputs", self.structured_outputs is not None),
        ]

    @property
    def guided_source(self) -> str | None:
        """The field that asks for guided decoding (its errors name it)."""
        given = [name for name, value in self._guided_fields() if value]
        if len(given) > 1:
            raise ValueError(f"{given[1]} cannot be combined with {given[0]}: choose one")
        return given[0] if given else None

    def _guided_params(self) -> dict[str, Any]:
        """SamplingParams' `structured_outputs` as given (its errors name it), else its
        `guided_decoding`."""
        if self.guided_source == "structured_outputs":
            return {"structured_outputs": self.structured_outputs}
        return {"guided_decoding": self._guided_decoding()}

    def _guided_decoding(self) -> dict[str, Any] | None:
        source = self.guided_source
        if source == "guided_choice":
            return {"choice": self.guided_choice}
        if source == "guided_json":
            return {"json_schema": _json_schema(self.guided_json, "guided_json")}
        if source == "guided_regex":
            return {"regex": self.guided_regex}
        if source == "guided_grammar":
            return {"grammar": self.guided_grammar}
        if source is None:
            return None
        response_format = self.response_format or {}
        kind = response_format.get("type")
        if kind == "json_object":
            return {"json_object": True}
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            return {"json_schema": _json_schema(schema, "response_format")}
        if kind == "structural_tag":  # vLLM's: structures and triggers beside the type
            return {"structural_tag": {k: v for k, v in response_format.items() if k != "type"}}
        raise ValueError(
            f"response_format type must be text, json_object, json_schema or structural_tag, got {kind!r}"
        )


def _json_schema(schema: Any, field: str) -> dict[str, Any]:
    """A schema as the request gave it: a mapping, or (vLLM's guided_json) its JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field} is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{field} needs a JSON schema object, got {schema!r}")
    return schema


class CompletionRequest(_GenerationRequest):
    """`POST /v1/completions`. A list of prompts gives one job per prompt; choice `i * n + j`
    is completion `j` of prompt `i`, as in OpenAI."""

    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    # vLLM's: prompts as their input states, each a [positions, hidden] tensor as torch.save
    # writes it, base64-encoded (one job each; the worker reads them, this layer has no torch)
    prompt_embeds: str | list[str] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None  # top alternatives per token, 0..20
    echo: bool = False  # each completion begins with its prompt (and the prompt's logprobs)
    suffix: str | None = None  # not supported: refused when set
    best_of: int | None = None  # only best_of == n is supported
    _embeds: list[bytes] | None = PrivateAttr(default=None)  # prompt_embeds decoded, once

    def sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Raises ValueError naming the field (SamplingParams' own checks); `defaults`: see
        _common_params."""
        return SamplingParams(
            max_tokens=self.max_tokens, logprobs=self.logprobs,
            prompt_logprobs=self._prompt_logprobs(), **self._common_params(defaults)
        )

    def _prompt_logprobs(self) -> int | None:
        """The request's own prompt_logprobs, or more for echo: the prompt's logprobs when
        logprobs are asked for, its decoded text when the prompt is token ids (this layer has
        no tokenizer). Either costs the prefix cache for this prompt: every position must be
        computed."""
        wanted = [self.prompt_logprobs] if self.prompt_logprobs is not None else []
        if self.echo and self.logprobs is not None:
            wanted.append(self.logprobs)
        elif self.echo and not all(isinstance(p, str) for p in self.prompts()):
            wanted.append(0)
        return max(wanted) if wanted else None

    def prompts(self) -> list[PromptInput]:
        """One prompt per job: a string, `{"prompt_token_ids": [...]}` or `{"prompt_embeds":
        bytes}`; ValueError naming prompt_embeds where one is not base64."""
        if self.prompt_embeds is not None:
            if self._embeds is None:
                given = [self.prompt_embeds] if isinstance(self.prompt_embeds, str) else self.prompt_embeds
                self._embeds = [_base64_bytes(e, "prompt_embeds") for e in given]
            return [{"prompt_embeds": e} for e in self._embeds]
        prompt = self.prompt
        if prompt is None:
            return []
        if isinstance(prompt, str):
            return [prompt]
        out: list[PromptInput] = []
        for item in prompt:
            if isinstance(item, int):  # one prompt of token ids
                return [{"prompt_token_ids": list(prompt)}]
            out.append(item if isinstance(item, str) else {"prompt_token_ids": list(item)})
        return out


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # OpenAI's: the arguments follow `parameters` exactly


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


MEDIA_PARTS = ("image_url", "input_audio", "audio_url")  # the content parts that are not text


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None
    image_url: dict[str, Any] | str | None = None  # {"url": data URL or http(s) URL}: api.images
    input_audio: dict[str, Any] | None = None  # OpenAI's {"data": base64 WAV, "format": "wav"}: api.images
    audio_url: dict[str, Any] | str | None = None  # vLLM's {"url": data URL of a WAV}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def has_images(self) -> bool:
        """Whether the message holds an image or an audio clip (which the worker widens into
        tokens by its size)."""
        return isinstance(self.content, list) and any(part.type in MEDIA_PARTS for part in self.content)


def _properties(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A JSON schema's properties; none where the schema has no such object."""
    properties = (parameters or {}).get("properties")
    return properties if isinstance(properties, dict) else {}


class ChatCompletionRequest(_GenerationRequest):
    """`POST /v1/chat/completions`; the worker applies the model's chat template."""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: up to the model's context (OpenAI's default)
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None  # alternatives per token, with logprobs=true
    include_reasoning: bool = True  # vLLM's: false leaves a reasoning model's thinking out of the reply
    tools: list[Tool] | None = None  # shown to the chat template
    # "auto" (the default with tools): the model decides, and its text is read for calls
    # (api.parsers.tool_calls); {"type": "function", "function": {"name": ...}}, or "required" with one
    # tool: the reply is a call of that function, its arguments guided by its parameters'
    # schema; "required" with several: a guided array of calls; "none": plain text
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True  # false: with "auto", only the first call is kept
    # vLLM's: variables for the chat template (e.g. {"enable_thinking": false} for Qwen3);
    # continue_final_message: the reply continues the last (assistant) message
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: a reply that goes on from a last assistant message begins with that message's text
    echo: bool = False
    # OpenAI's predicted output, {"type": "content", "content": text or text parts}: workers
    # that guess with n-grams guess from it too (a reply that repeats it comes sooner)
    prediction: dict[str, Any] | None = None
    # OpenAI's: how hard a reasoning model thinks; the chat template's `reasoning_effort`
    # (gpt-oss's sets "Reasoning: low" and so on in its system message)
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    def echoed(self) -> str | None:
        """With echo, the text a reply begins with: the last message's, when it is the
        assistant's (the reply goes on from it); else None."""
        last = self.messages[-1] if self.messages else None
        if not self.echo or last is None or last.role != "assistant":
            return None
        if isinstance(last.content, list):
            return "".join(part.text or "" for part in last.content if part.type == "text")
        return last.content or ""

    def template_kwargs(self) -> dict[str, Any]:
        """What the worker's chat template gets besides the messages and tools."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        if not self.add_generation_prompt or self.continue_final_message:
            kwargs["add_generation_prompt"] = self.add_generation_prompt and not self.continue_final_message
        if self.continue_final_message:
            kwargs["continue_final_message"] = True
        return kwargs

    def thinking_on(self) -> bool:
        """Whether chat_template_kwargs turn the template's thinking on (DeepSeek-V3.1's
        `thinking`, or `enable_thinking`), for templates that do not think unless asked."""
        kwargs = self.chat_template_kwargs or {}
        return kwargs.get("thinking") is True or kwargs.get("enable_thinking") is True

    def thinking_off(self) -> bool:
        """Whether chat_template_kwargs turn the template's thinking off: `enable_thinking`
        (Qwen3, Nemotron 3) or `thinking` (DeepSeek-V3.1) false."""
        kwargs = self.chat_template_kwargs or {}
        return kwargs.get("enable_thinking", True) is False or kwargs.get("thinking", True) is False

    def forced_tool(self) -> FunctionDefinition | None:
        """The function the reply must call; ValueError naming tool_choice when unsupported."""
        choice = self.tool_choice
        tools = [t.function for t in self.tools or []]
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            found = [f for f in tools if f.name == name]
            if not found:
                raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
            return found[0]
        if choice not in (None, "none", "auto", "required"):
            raise ValueError(
                f"tool_choice must be none, auto, required or a named function, got {choice!r}"
            )
        if choice in ("auto", "required") and not tools:
            raise ValueError(f"tool_choice {choice!r} needs tools")
        return tools[0] if choice == "required" and len(tools) == 1 else None

    def tool_calls_form(self) -> str | None:
        """How the reply is read for calls: "auto" when the model decides (in the format the
        server's GENQ_TOOL_CALL_PARSER names), "json" when it must call one or more of several
        tools ("required": guided into a JSON array of calls); None when it is not read for
        calls."""
        if not self.tools or self.tool_choice not in (None, "auto", "required"):
            return None
        if self.tool_choice == "required":
            return "json" if len(self.tools) > 1 else None
        return "auto"

    def string_parameters(self) -> tuple[tuple[str, str], ...]:
        """(tool, parameter) for each parameter the tools declare a string (`"type": "string"`
        or `["string"]`): GLM's calls write those values as raw text (api.parsers.glm_tool_calls)."""
        return tuple(
            (tool.function.name, name)
            for tool in self.tools or []
            for name, schema in _properties(tool.function.parameters).items()
            if isinstance(schema, dict) and schema.get("type") in ("string", ["string"])
        )

    def _guided_fields(self) -> list[tuple[str, bool]]:
        guided = self.forced_tool() is not None or self.tool_calls_form() == "json"
        return [*super()._guided_fields(), ("tool_choice", guided)]

    def _guided_decoding(self) -> dict[str, Any] | None:
        """A forced tool call: its arguments follow the function's parameters schema; a
        required call of several tools: an array of calls, each named and fit to its tool."""
        if self.guided_source == "tool_choice":
            function = self.forced_tool()
            if function is not None:
                return {"json_schema": function.parameters or {"type": "object"}}
            tools = [(t.function.name, t.function.parameters) for t in self.tools or []]
            return {"json_schema": calls_schema(tools, self.parallel_tool_calls)}
        return super()._guided_decoding()

    def sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Unset, max_tokens is the model's generation_config max_new_tokens where it has
        one, else up to the context (OpenAI's); completions keep OpenAI's 16."""
        max_tokens = self.max_completion_tokens or self.max_tokens
        common = self._common_params(defaults)
        default_max_tokens = (defaults or {}).get("max_tokens")
        if max_tokens is None and default_max_tokens is not None:
            # the model's default is cut to the room the prompt leaves (vLLM's), never a 400
            max_tokens, common["clamp_max_tokens"] = default_max_tokens, True
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(
            max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=self.prompt_logprobs,
            prediction=self._predicted_text(), **common,
        )

    def _predicted_text(self) -> str | None:
        if self.prediction is None:
            return None
        content = self.prediction.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if self.prediction.get("type") != "content" or not isinstance(content, str) or not content:
            raise ValueError('prediction must be {"type": "content", "content": text or text parts}')
        return content


# ---------------------------------------------------------------------------------------------
# Job endpoints


class ChatJobRequest(ChatCompletionRequest):
    kind: Literal["chat"] = "chat"
    job_id: str | None = None  # idempotent submit: a known id returns that job
    deadline_s: float | None = None  # past it, the worker aborts the job


class CompletionJobRequest(CompletionRequest):
    kind: Literal["completion"] = "completion"
    job_id: str | None = None
    deadline_s: float | None = None


def _job_kind(body: Any) -> str:
    """`kind` when given, else chat when the body has `messages`."""
    if isinstance(body, dict):
        return body.get("kind") or ("chat" if "messages" in body else "completion")
    return getattr(body, "kind", "completion")


JobRequest = Annotated[
    Annotated[ChatJobRequest, Tag("chat")] | Annotated[CompletionJobRequest, Tag("completion")],
    Discriminator(_job_kind),
]


class EmbeddingRequest(BaseModel):
    """`POST /v1/embeddings`: one embedding job per input, as OpenAI's (plus vLLM's
    `normalize`, `truncate_prompt_tokens` and `priority`), or one of a conversation
    (vLLM's chat form: `messages`, rendered by the model's chat template, by default without
    the generation prompt)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = False  # chat form: end with the assistant's header
    chat_template_kwargs: dict[str, Any] | None = None  # chat form: more for the template
    encoding_format: Literal["float", "base64"] = "float"
    # a Matryoshka model's vectors cut to their first `dimensions` values (the workers refuse it
    # for other models)
    dimensions: int | None = None
    user: str | None = None
    normalize: bool = True  # False: the raw pooled hidden state
    truncate_prompt_tokens: int | None = None  # vLLM's: pool only the last k tokens (-1: max_model_len)
    priority: int = 0

    def inputs(self) -> list[PromptInput]:
        """One prompt per job: a string, `{"prompt_token_ids": [...]}`, or a conversation."""
        if self.messages is not None:
            messages = [{"role": m.role, "content": _text(m.content)} for m in self.messages]
            kwargs = {**(self.chat_template_kwargs or {}), "add_generation_prompt": self.add_generation_prompt}
            return [{"messages": messages, "chat_template_kwargs": kwargs}]
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [self.input]
        if self.input and all(isinstance(t, int) for t in self.input):
            return [{"prompt_token_ids": list(cast(list[int], self.input))}]
        return [item if isinstance(item, str) else {"prompt_token_ids": list(cast(list[int], item))}
                for item in self.input]


def _text(content: Any) -> str:
    """A message's content as text (text parts joined)."""
    if isinstance(content, list):
        return "".join(getattr(part, "text", None) or "" for part in content)
    return content or ""


def _base64_bytes(text: str, field: str) -> bytes:
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{field} must be base64 (of torch.save's bytes of a tensor): {exc}") from exc
    if not data:
        raise ValueError(f"{field} must not be empty")
    return data
