"""A conversation as a prompt, through the model's own chat template (transformers'
`apply_chat_template`). Shared by the engine, which runs it for every chat job, and the API's
/tokenize, which must count the same tokens; plain Python (transformers' tokenizers do not
need torch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool | None = None,
    tools: list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
    **template_kwargs: Any,
) -> dict[str, Any]:
    """The prompt for a conversation, as text and token ids. The template already holds any
    special tokens the model wants, so none are added when encoding it. `tools` and
    `template_kwargs` (the template's own variables) go to the template, which shows the
    tools to the model if it knows how. By default the prompt begins the assistant's reply;
    with `continue_final_message` it ends inside the last (assistant) message instead."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    if add_generation_prompt is None:
        add_generation_prompt = not continue_final_message
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=cast("list[dict[Any, Any] | Callable[..., Any]] | None", tools),
        **template_kwargs,
    )
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
