"""A checkpoint's multi-token-prediction (MTP) layer, run as a draft (vLLM's
`speculative_config={"method": "mtp"}`): DeepSeek-V3, GLM-4.5, GLM-4.7-Flash, Qwen3-Next and
Qwen3.5 were trained with one more layer that guesses the token after next, and ship it.

Its row for position i reads token i + 1 and the target model's final (normed) hidden state
at i: each is RMS-normed, the two are concatenated and projected back to the hidden width
(`eh_proj`), one decoder layer of the model's own kind runs over them with a KV cache of its
own (full attention; the model's experts where its later layers have them), and a last norm
gives the state whose logits, under the target's LM head, guess token i + 2. A further guess
feeds the layer its own output in place of the target's state. This is transformers'
`MtpModel` arithmetic; the embedding and LM head are the target's (the copies DeepSeek's
checkpoints keep beside the layer are not read).

The layer is a one-layer model of the target's family (`mtp_hf_config`), so everything genq
runs for a decoder layer (its attention backends, experts, quantized weights) runs it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from worker.model_executor.models.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    architecture_of,
)
from worker.model_executor.models.llama import HiddenStateDraft, LlamaForCausalLM, make_norm

# the checkpoint's names for the layer's own parts -> genq's; first DeepSeek's layout
# (model.layers.<num_hidden_layers>.*: DeepSeek-V3, GLM-4.5, GLM-4.7-Flash), then Qwen's (mtp.*)
_DEEPSEEK_PARTS = {"enorm.": "enorm.", "hnorm.": "hnorm.", "eh_proj.": "eh_proj.", "shared_head.norm.": "norm."}
_DEEPSEEK_COPIES = ("embed_tokens.", "shared_head.head.")  # the target's embedding and head, again
_QWEN_PARTS = {"fc.": "eh_proj.", "pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm.", "norm.": "norm."}
DEEPSEEK_LAYOUT = ("deepseek_v3", "glm4_moe", "glm4_moe_lite")
QWEN_LAYOUT = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def _family(hf_config: Any) -> str:
    arch = architecture_of(hf_config)
    return SUPPORTED_ARCHITECTURES.get(arch, arch)


def num_mtp_layers(hf_config: Any) -> int:
    """The MTP layers the model's config says its checkpoint holds (DeepSeek's and GLM's
    `num_nextn_predict_layers`, Qwen's `mtp_num_hidden_layers`); 0 for a family without."""
    family = _family(hf_config)
    if family in DEEPSEEK_LAYOUT:
        return int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)
    if family in QWEN_LAYOUT:
        return int(getattr(hf_config, "mtp_num_hidden_layers", 0) or 0)
    return 0


def check_has_mtp(hf_config: Any) -> None:
    """ValueError naming the model unless its config says it has an MTP layer genq runs."""
    if num_mtp_layers(hf_config) < 1:
        families = ", ".join(DEEPSEEK_LAYOUT + QWEN_LAYOUT)
        raise ValueError(f"speculative method 'mtp' needs a model with multi-token-prediction layers; "
                         f"{architecture_of(hf_config, 'this model')}'s config names none "
                         f"(genq runs those of {families})")
    if getattr(hf_config, "mtp_use_dedicated_embeddings", False):
        raise ValueError("this model's MTP layer has an embedding of its own (mtp_use_dedicated_embeddings), "
                         "which genq does not run yet; it shares the target's")


def mtp_hf_config(hf_config: Any) -> Any:
    """The config of a one-layer model of the target's family whose layer is the MTP layer's
    kind: full attention, with experts where the model has them (as transformers'
    `get_mtp_config`), and no MTP layer of its own; `mtp_prefix` names the layer's tensors."""
    cfg = copy.deepcopy(hf_config)
    cfg.mtp_prefix = _prefix(hf_config)
    cfg.num_hidden_layers = 1
    if getattr(cfg, "first_k_dense_replace", None) is not None:
        cfg.first_k_dense_replace = 0
    if getattr(cfg, "mlp_layer_types", None):
        cfg.mlp_layer_types = ["sparse"]
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = ["full_attention"]
    if getattr(cfg, "mlp_only_layers", None):
        cfg.mlp_only_layers = []
    if _family(hf_config) in DEEPSEEK_LAYOUT:
        cfg.num_nextn_predict_layers = 0
    else:
        cfg.mtp_num_hidden_layers = 0
    return cfg


def _prefix(hf_config: Any) -> str:
    """What the MTP layer's tensors' names start with."""
    return f"model.layers.{hf_config.num_hidden_layers}." if _family(hf_config) in DEEPSEEK_LAYOUT else "mtp."


def mtp_tensor_filter(mtp_config: Any) -> Callable[[str], bool]:
    """Which of the checkpoint's tensors are the (first) MTP layer's (`mtp_config`:
    mtp_hf_config's), so that loading it reads nothing else."""
    prefix = mtp_config.mtp_prefix
    if _family(mtp_config) in DEEPSEEK_LAYOUT:
        return lambda name: name.startswith(prefix) and not name.startswith(_DEEPSEEK_COPIES, len(prefix))
    return lambda name: name.startswith("mtp.") and (
        name.startswith("mtp.layers.0.") or not name.startswith("mtp.layers."))


def mtp_weights(weights: Iterable[tuple[str, torch.Tensor]], mtp_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The MTP layer's tensors (mtp_tensor_filter's) named as the one-layer model's: its
    decoder layer as layer 0, its norms and projection as `model.enorm`, `model.hnorm`,
    `model.eh_proj`, and its last norm as the model's final `model.norm`."""
    deepseek = _family(mtp_config) in DEEPSEEK_LAYOUT
    prefix = mtp_config.mtp_prefix
    parts = _DEEPSEEK_PARTS if deepseek else _QWEN_PARTS
    for name, tensor in weights:
        local = name.removeprefix(prefix)
        part = next((p for p in parts if local.startswith(p)), None)
        if part is not None:
            yield "model." + parts[part] + local[len(part):], tensor
        elif deepseek:
            yield "model.layers.0." + local, tensor
        else:  # mtp.layers.0.*
            yield "model." + local, tensor


class MultiTokenPredictor(HiddenStateDraft):
    """The MTP layer as a one-layer model (`cfg` from mtp_hf_config). Its embedding and LM
    head are the target model's, given by `share_with` once the runner has loaded it."""

    def __init__(self, cfg: ModelConfig, use_kernels: bool = False):
        super().__init__(cfg, use_kernels)
        hidden = cfg.hidden_size
        self.enorm = make_norm(cfg, hidden, use_kernels)
        self.hnorm = make_norm(cfg, hidden, use_kernels)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        # the target's stand in (share_with): a row each of their own until then
        self.embed_tokens = nn.Embedding(1, hidden, _weight=torch.empty(1, hidden))
        self.lm_head = nn.Linear(hidden, 1, bias=False)

    def share_with(self, target: LlamaForCausalLM) -> None:
        self.embed_tokens = target.embed_tokens
        self.lm_head = target.lm_head

    def checkpoint_filter(self) -> Callable[[str], bool]:
        return mtp_tensor_filter(self.config.hf_config)

    def load_weights(self, weights, split=None, deal=None) -> None:  # type: ignore[no-untyped-def]
        super().load_weights(mtp_weights(weights, self.config.hf_config), split, deal)

    def _check_complete(self, loaded: set[str]) -> None:
        if not loaded:
            raise ValueError(f"the checkpoint holds no multi-token-prediction layer (no tensors named "
                             f"{self.config.hf_config.mtp_prefix}*), though its config names one")
        super()._check_complete(loaded | {"embed_tokens.weight:None", "lm_head.weight:None"})

    def draft(self, embeds: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
              meta: Any, hidden: torch.Tensor) -> torch.Tensor:
        """Row i: token i + 1's embedding and the target's final state at i, or this layer's
        output; the layer's output, normed."""
        embeds = self.enorm(embeds)
        x = self.eh_proj(torch.cat([embeds, self.hnorm(hidden.to(embeds.dtype))], dim=-1))
        return self.decode(x, positions, kv_caches, meta)
