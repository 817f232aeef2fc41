"""EAGLE-3 draft heads (vLLM's `speculative_config={"method": "eagle3", "model": DIR}`): one
Llama decoder layer trained to guess a target model's next tokens from the target's own
hidden states, published for Llama 3, Qwen3, gpt-oss and others, in SpecForge's checkpoint
layout (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`) or the speculators library's (Red Hat's
`*-speculator.eagle3`: `layers.0.*`, its layer's config nested in `transformer_layer_config`).

The target's residual stream before three of its layers (low, middle, high; the head's
`eagle_config.eagle_aux_hidden_state_layer_ids`, else 2, L/2 and L - 3) is concatenated and
projected to the hidden width (`fc`); a further guess reads the head's own output (before its
final norm) instead. Row i reads token i + 1 and that state: the token's embedding and the
state are each RMS-normed and concatenated, so the layer's attention reads twice the hidden
width; the state itself is the residual. The head's LM head covers `draft_vocab_size`
tokens, the target token of each being its id plus `d2t`'s entry. The embedding is the
target's unless the head has its own.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worker.model_executor.model_loader import read_config
from worker.model_executor.models.config import ModelConfig, architecture_of
from worker.model_executor.models.llama import (
    Attention,
    DecoderLayer,
    HiddenStateDraft,
    LlamaForCausalLM,
    make_norm,
)

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def is_eagle3(hf_config: Any) -> bool:
    return architecture_of(hf_config) in EAGLE3_ARCHITECTURES


def read_head_config(path: Path) -> Any:
    """The head's config, as a one-layer Llama's with EAGLE-3's fields (`draft_vocab_size`,
    `norm_before_residual`, `eagle_config`); a speculators-format one is rebuilt so from the
    layer config it nests. Speculators' other algorithms and the normalizations genq does not
    run are refused by name."""
    from transformers import LlamaConfig

    raw = json.loads((path / "config.json").read_text())
    kind = raw.get("speculators_model_type")
    if kind is None:
        return read_config(path)
    if kind != "eagle3":
        raise ValueError(f"{path} holds a speculators {kind!r} model; genq serves its eagle3 heads only")
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        if raw.get(flag):
            raise ValueError(f"the EAGLE-3 head in {path} sets {flag}, a normalization genq does not run")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict) or layer.get("model_type", "llama") != "llama":
        raise ValueError(f"the EAGLE-3 head in {path} needs a Llama transformer_layer_config, got {layer!r}")
    config = LlamaConfig(**{k: v for k, v in layer.items() if k not in ("architectures", "model_type")})
    config.architectures = [EAGLE3_ARCHITECTURES[1]]
    config.draft_vocab_size = raw.get("draft_vocab_size") or config.vocab_size
    config.target_hidden_size = raw.get("target_hidden_size")
    config.norm_before_residual = raw.get("norm_before_residual", True)  # (the library's default)
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        config.eagle_config = {"eagle_aux_hidden_state_layer_ids": raw["eagle_aux_hidden_state_layer_ids"]}
    return config


def aux_layers(head_config: Any, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input (the residual stream before them) the head reads."""
    ids = (getattr(head_config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(ids) if ids else (2, num_target_layers // 2, num_target_layers - 3)
    if len(layers) != 3 or not all(0 <= i < num_target_layers for i in layers):
        raise ValueError(f"the EAGLE-3 head reads the target's layers {layers}: three of its "
                         f"{num_target_layers} are needed")
    return layers


def eagle3_hf_config(head_config: Any, model_path: Path) -> Any:
    """The head's config as a one-layer Llama's, noting whether its checkpoint has an
    embedding of its own (`eagle3_own_embedding`)."""
    from safetensors import safe_open

    cfg = copy.deepcopy(head_config)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.num_hidden_layers = 1
    cfg.tie_word_embeddings = False
    names: list[str] = []
    for file in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names += f.keys()
    cfg.eagle3_own_embedding = any(name.endswith("embed_tokens.weight") for name in names)
    return cfg


def _head_weights(weights: Iterable[tuple[str, torch.Tensor]], d2t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The head's tensors in a one-layer Llama's names (`d2t` copied in, `t2d` not read)."""
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if name == "d2t":
            d2t.copy_(tensor)
        elif name.startswith(("midlayer.hidden_norm.", "layers.0.hidden_norm.")):
            yield "model.hidden_norm." + name.rsplit(".", 1)[1], tensor
        elif name.startswith("midlayer."):
            yield "model.layers.0." + name.removeprefix("midlayer."), tensor
        elif name != "t2d":
            yield (name if name.startswith("lm_head.") else "model." + name), tensor


class Eagle3Head(HiddenStateDraft):
    """The head as a one-layer model (`cfg` from eagle3_hf_config)."""

    d2t: torch.Tensor  # [draft vocab]: each head token's target id less its own
    target_ids: torch.Tensor  # [draft vocab]: each head token's target id

    def __init__(self, cfg: ModelConfig, use_kernels: bool = False):
        super().__init__(cfg, use_kernels)
        hf, hidden = cfg.hf_config, cfg.hidden_size
        attention = self._layer().self_attn
        assert isinstance(attention, Attention)
        attention.qkv_proj = nn.Linear(2 * hidden, attention.qkv_proj.out_features, bias=cfg.attention_bias)
        self.hidden_norm = make_norm(cfg, hidden, use_kernels)
        self.fc = nn.Linear(3 * (getattr(hf, "target_hidden_size", None) or hidden), hidden, bias=False)
        self.draft_vocab_size = getattr(hf, "draft_vocab_size", None) or cfg.vocab_size
        self.lm_head = nn.Linear(hidden, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("target_ids", torch.arange(self.draft_vocab_size))
        self.same_ids = self.draft_vocab_size == cfg.vocab_size  # (no d2t: head token i is target token i)
        self.norm_before_residual = bool(getattr(hf, "norm_before_residual", False))
        self.own_embedding = bool(getattr(hf, "eagle3_own_embedding", True))
        if not self.own_embedding:  # the target's stands in (share_with)
            self.embed_tokens = nn.Embedding(1, hidden, _weight=torch.empty(1, hidden))

    def _layer(self) -> DecoderLayer:
        layer = self.layers[0]
        assert isinstance(layer, DecoderLayer)
        return layer

    def share_with(self, target: LlamaForCausalLM) -> None:
        if not self.own_embedding:
            self.embed_tokens = target.embed_tokens

    def init_dummy_weights(self, std: float, seed: int = 0) -> None:
        super().init_dummy_weights(std, seed)
        self._map_ids(torch.zeros_like(self.d2t))

    def load_weights(self, weights, split=None, deal=None) -> None:  # type: ignore[no-untyped-def]
        d2t = torch.zeros(self.draft_vocab_size, dtype=torch.long)
        super().load_weights(_head_weights(weights, d2t), split, deal)
        self._map_ids(d2t)

    def _map_ids(self, d2t: torch.Tensor) -> None:
        """Each head token's target id, once, on the head's device (the buffers made on the
        meta device hold nothing until now)."""
        self.d2t.copy_(d2t)
        self.target_ids.copy_(torch.arange(self.draft_vocab_size, device=d2t.device) + d2t)
        self.same_ids = self.draft_vocab_size == self.config.vocab_size and not d2t.any()

    def _check_complete(self, loaded: set[str]) -> None:
        super()._check_complete(loaded if self.own_embedding else loaded | {"embed_tokens.weight:None"})

    def draft(self, embeds: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
              meta: Any, hidden: torch.Tensor) -> torch.Tensor:
        """Row i: token i + 1's embedding and the target's states before its aux layers [T, 3 x
        target hidden], or the head's own output [T, hidden]; the head's output before its final
        norm."""
        layer = self._layer()
        embeds = layer.input_layernorm(embeds)
        hidden = hidden.to(embeds.dtype)
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = self.fc(hidden)
        normed = self.hidden_norm(hidden)
        # (cloned: the fused norm kernel adds into it in place)
        residual = (normed if self.norm_before_residual else hidden).clone()
        rope = self._layer_ropes(positions, embeds.dtype)[0]
        x = layer.self_attn(torch.cat([embeds, normed], dim=-1), rope, kv_caches[0], meta.for_layer(0))
        x, residual = layer.post_attention_layernorm(x, residual)
        return layer.mlp(x) + residual

    def compute_logits(self, hidden: torch.Tensor, reuse: bool = False) -> torch.Tensor:
        """Logits over the target's vocabulary: the head's tokens at their target ids, -inf
        elsewhere."""
        logits = super().compute_logits(self.norm(hidden), reuse)  # [rows, draft vocab]
        if self.same_ids:
            return logits
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self.target_ids] = logits
        return full
