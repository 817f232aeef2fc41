"""`POST /tokenize` and `POST /detokenize`, as vLLM serves them: a prompt or a conversation
as the token ids the workers would see (the same tokenizer and chat template), and token ids
back as text."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from api.chat import chat_ids, templated
from api.deps import StateDep
from api.errors import invalid_param
from api.generate import resolve_model
from api.request_bodies import ChatCompletionRequest, ChatMessage
from api.settings import Settings
from api.tokenizers import base_model

router = APIRouter(tags=["vllm"])


class TokenizeRequest(BaseModel):
    """vLLM's: a completion prompt, or chat messages (with the chat fields that shape them)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None  # shown to the template, as chat shows them
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: StateDep) -> dict[str, Any]:
    model, max_model_len = await base_model(state.cluster, await resolve_model(state, body.model))
    tokenizer = await state.tokenizers.get(state.client, model)
    if body.messages is not None:
        if any(m.has_images() for m in body.messages):
            raise invalid_param("messages", "messages with images or audio cannot be tokenized here: the worker widens "
                                "each image and clip into as many tokens as its size makes")
        ids = _chat_ids(tokenizer, body, state.settings)
    else:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return out


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: StateDep) -> dict[str, Any]:
    model, _ = await base_model(state.cluster, await resolve_model(state, body.model))
    tokenizer = await state.tokenizers.get(state.client, model)
    bad = [t for t in body.tokens if not 0 <= t < len(tokenizer)]
    if bad:
        raise invalid_param("tokens", f"token id {bad[0]} is outside the vocabulary [0, {len(tokenizer)})")
    return {"prompt": tokenizer.decode(body.tokens)}


def _chat_ids(tokenizer: Any, body: TokenizeRequest, settings: Settings) -> list[int]:
    """The ids a chat job with these messages would run on (`chat_ids`)."""
    fields = {"messages": body.messages, "tools": body.tools, "chat_template_kwargs": body.chat_template_kwargs,
              "add_generation_prompt": body.add_generation_prompt,
              "continue_final_message": body.continue_final_message}
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise invalid_param(".".join(str(p) for p in first["loc"]), first["msg"]) from None
    ids = chat_ids(tokenizer, templated(chat, settings))
    if body.add_special_tokens:
        ids = tokenizer.build_inputs_with_special_tokens(ids)
    return ids
