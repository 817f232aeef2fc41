"""The served models' tokenizers, as the workers published them (worker.queue.tokenizer), for
/tokenize and /detokenize: loaded on first use and again when a worker publishes another.
transformers' fast tokenizers need no torch; the chat template is rendered as the workers
render it (producer.chat_template)."""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

from api.cluster import Cluster
from api.errors import APIError
from producer.async_client import AsyncClient
from producer.chat_template import render_chat
from producer.protocol import TOKENIZER_EOS_FIELD, TOKENIZER_LABELS_FIELD, Job


class Tokenizers:
    def __init__(self) -> None:
        self._loaded: dict[str, tuple[bytes, Any]] = {}  # model -> (digest, tokenizer)

    async def get(self, client: AsyncClient, model: str) -> Any:
        """The tokenizer workers serving `model` published; 503 if none has yet."""
        key = client.keys.tokenizer(model)
        digest = await client.redis.hget(key, "digest")
        if digest is None:
            raise APIError(503, f"No worker has published the tokenizer of `{model}` yet.",
                           type="service_unavailable", code="tokenizer_unavailable")
        loaded = self._loaded.get(model)
        if loaded is not None and loaded[0] == digest:
            return loaded[1]
        files = await client.redis.hgetall(key)
        tokenizer = await asyncio.to_thread(
            _load, {k.decode(): v for k, v in files.items() if k.decode() not in ("digest", TOKENIZER_EOS_FIELD, TOKENIZER_LABELS_FIELD)}
        )
        self._loaded[model] = (digest, tokenizer)
        return tokenizer


async def eos_token_ids(client: AsyncClient, model: str, tokenizer: Any) -> set[int]:
    """The ids that end a sequence of `model`, as its workers published them (a worker that
    predates that: the tokenizer's own)."""
    published = await client.redis.hget(client.keys.tokenizer(model), TOKENIZER_EOS_FIELD)
    if published:
        return {int(t) for t in published.decode().split(",") if t}
    return {tokenizer.eos_token_id} - {None}


async def labels(client: AsyncClient, model: str) -> list[str] | None:
    """A classification model's labels, as its workers published them; None for another model."""
    published = await client.redis.hget(client.keys.tokenizer(model), TOKENIZER_LABELS_FIELD)
    return json.loads(published) if published else None


async def base_model(cluster: Cluster, model: str, max_age_s: float = 0.0) -> tuple[str, int | None]:
    """The base model behind a served name (a LoRA adapter's is its parent), and the smallest
    max_model_len of the workers serving it (None if they do not say); `max_age_s`: see
    Cluster.workers."""
    serving = [w.info for w in await cluster.workers(max_age_s) if w.serving]
    base = next((info.model for info in serving if model in info.names or model in info.adapters), model)
    limits = [info.max_model_len for info in serving if info.model == base and info.max_model_len]
    return base, min(limits) if limits else None


def job_prompt_ids(tokenizer: Any, job: Job) -> list[int]:
    """The token ids a worker runs `job` on: its text with the tokenizer's special tokens,
    its token ids as given, or its messages rendered by the chat template as workers render
    them. ValueError when the template refuses the messages."""
    if job.prompt_token_ids is not None:
        return list(job.prompt_token_ids)
    if job.prompt is not None:
        return list(tokenizer.encode(job.prompt, add_special_tokens=True))
    try:
        rendered = render_chat(tokenizer, job.messages or [], tools=job.tools, **(job.chat_template_kwargs or {}))
    except Exception as exc:  # the template's own refusal (jinja2's TemplateError, ValueError)
        raise ValueError(f"The chat template refused the messages: {exc}") from None
    return list(rendered["prompt_token_ids"])


def _load(files: dict[str, bytes]) -> Any:
    from transformers import PreTrainedTokenizerFast  # no torch: the API stays torch-free

    with tempfile.TemporaryDirectory(prefix="genq-tokenizer-") as tmp:
        for name, data in files.items():
            (Path(tmp) / Path(name).name).write_bytes(data)
        return PreTrainedTokenizerFast.from_pretrained(tmp)
