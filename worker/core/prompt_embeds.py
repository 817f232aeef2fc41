"""Prompts given as embeddings (vLLM's `{"prompt_embeds": tensor}`): the input states of
the prompt's positions, as transformers' `inputs_embeds` takes them, in place of token ids.

Such a prompt holds placeholder token ids (PLACEHOLDER_ID, one per position) for the
scheduler and the KV cache, and its embeddings stand in for their rows the way an image's
do (worker.core.multimodal's ImageEmbeddings): on the host until the request ends, each prefill
chunk copying its rows. Its blocks are keyed in the prefix cache by a digest of the
embeddings, so the same embeddings are served from the cache and others never are. The
prompt has no tokens to penalize, to report logprobs of or to echo: penalties and logits
processors see an empty prompt, and prompt_logprobs is refused by name. Through the queue the
embeddings travel as `torch.save`'s bytes (vLLM's API takes them so, base64-encoded), read
back with `weights_only=True`.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

import torch

PLACEHOLDER_ID = 0  # the token id each embedded position holds in the engine


def prompt_embeds_of(prompt: Any) -> torch.Tensor | bytes | None:
    """A prompt dict's `prompt_embeds` (a tensor, or its torch.save bytes), if any; ValueError
    where it comes with another form of prompt."""
    if not isinstance(prompt, dict) or prompt.get("prompt_embeds") is None:
        return None
    others = sorted(k for k in prompt if k not in ("prompt_embeds", "cache_salt") and prompt[k] is not None)
    if others:
        raise ValueError(f"a prompt given as prompt_embeds takes nothing else, got {', '.join(others)}")
    return prompt["prompt_embeds"]


def checked_embeds(given: torch.Tensor | bytes, hidden_size: int) -> torch.Tensor:
    """The embeddings as [positions, hidden_size] floats on the host; ValueError naming what is
    wrong (bytes that are not one saved tensor, its shape, its dtype, a value not finite)."""
    embeds = _load(given) if isinstance(given, (bytes, bytearray, memoryview)) else given
    if not isinstance(embeds, torch.Tensor):
        raise ValueError(f"prompt_embeds must be a tensor (or its torch.save bytes), got {type(embeds).__name__}")
    if embeds.dim() == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.dim() != 2 or embeds.shape[1] != hidden_size or embeds.shape[0] < 1:
        raise ValueError(f"prompt_embeds must be [positions, {hidden_size}] (the model's hidden size), "
                         f"got {list(embeds.shape)}")
    if not embeds.is_floating_point():
        raise ValueError(f"prompt_embeds must be floating point, got {embeds.dtype}")
    embeds = embeds.detach().to("cpu")
    if not bool(torch.isfinite(embeds).all()):
        raise ValueError("prompt_embeds holds values that are not finite")
    return embeds


def _load(data: bytes | bytearray | memoryview) -> Any:
    try:
        return torch.load(io.BytesIO(bytes(data)), map_location="cpu", weights_only=True)
    except Exception as exc:  # whatever the bytes make torch.load raise: the prompt's fault
        raise ValueError(f"prompt_embeds is not a tensor saved with torch.save: {type(exc).__name__}: {exc}") from exc


def embeds_digest(embeds: torch.Tensor) -> int:
    """What keys the prompt's blocks in the prefix cache: its shape, dtype and values."""
    data = embeds.contiguous().view(torch.uint8).numpy().tobytes()
    header = f"{embeds.dtype}:{list(embeds.shape)}".encode()
    return int.from_bytes(hashlib.blake2b(header + data, digest_size=8).digest(), "little")
