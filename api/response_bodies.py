"""Response bodies, in OpenAI's shapes (plus vLLM's extras) and genq's job views. Stream
chunks are built as dicts in `api.render`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class JobCreated(BaseModel):
    id: str
    object: Literal["job"] = "job"
    status: str
    created: int
    enqueued: bool  # False: a job with this id existed already (idempotent submit)


class JobOutput(BaseModel):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # served by the workers' prefix cache


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None  # when the workers report it

    @classmethod
    def from_protocol(cls, usage: dict[str, int]) -> Usage:
        """A protocol usage dict (with cached_tokens when the worker reports it)."""
        cached = usage.get("cached_tokens")
        return cls(
            prompt_tokens=usage.get("prompt_tokens", 0),
            completion_tokens=usage.get("completion_tokens", 0),
            total_tokens=usage.get("total_tokens", 0),
            prompt_tokens_details=None if cached is None else PromptTokensDetails(cached_tokens=cached),
        )


class JobView(BaseModel):
    """`GET /v1/jobs/{id}`: the record; `outputs` and `usage` once the job has ended."""

    id: str
    object: Literal["job"] = "job"
    status: str
    n: int = 1
    worker: str | None = None
    submitted_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    error_type: str | None = None  # "invalid_request": the job itself was at fault
    usage: Usage | None = None
    outputs: list[JobOutput] | None = None
    embedding: list[float] | None = None  # an embedding job's vector (POST /v1/embeddings)
    cancel_requested: bool | None = None  # set by DELETE


# vLLM's `prompt_logprobs`: per prompt token (None for the first), the token and its top
# alternatives as {token id: {"logprob", "rank", "decoded_token"}}
PromptLogprobs = list[dict[str, dict[str, Any]] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that matched
    prompt_logprobs: PromptLogprobs | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids: the tokens generated
    prompt_token_ids: list[int] | None = None  # and the prompt's, as the worker ran it


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    service_tier: str | None = None  # as chat's


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None  # the calls; a forced call has content None
    reasoning_content: str | None = None  # a reasoning model's thinking (GENQ_REASONING_PARSER)
    reasoning: str | None = None  # the same, under the name vLLM gives it now

    def model_post_init(self, context: Any) -> None:
        self.reasoning = self.reasoning_content


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids: the tokens generated


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids: the prompt's, after its template
    service_tier: str | None = None  # the tier it ran on: default, flex or priority (its priority lane)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "genq"
    workers: int = 0  # live workers serving it
    max_model_len: int | None = None  # as vLLM reports it: the smallest its workers allow
    parent: str | None = None  # a LoRA adapter's base model, as vLLM reports it


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
