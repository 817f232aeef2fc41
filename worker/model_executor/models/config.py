"""What the engine needs to know about a model, read from its Hugging Face config."""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from worker.model_executor.models.kv_scales import kv_cache_scheme
from worker.model_executor.models.quant import QuantConfig

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    # an encoder-decoder: its decoder's config as language_config gives it (worker.model_executor.models.whisper)
    "WhisperForConditionalGeneration": "whisper",
    "MistralForCausalLM": "mistral",
    "MinistralForCausalLM": "mistral",  # Ministral-8B: Mistral with its windows named per layer
    # Ministral 3: Mistral whose queries are scaled up with the position past the original length
    "Ministral3ForCausalLM": "ministral3",
    "SmolLM3ForCausalLM": "smollm3",  # Llama without RoPE on every fourth layer (NoPE)
    "SeedOssForCausalLM": "seed_oss",  # Llama with q/k/v biases (and its own switch for o's)
    "Ernie4_5ForCausalLM": "ernie4_5",  # Llama whose RoPE rotates interleaved pairs
    # GLM-4-0414: interleaved RoPE over half of each head, Gemma 2's four norms a layer,
    # checkpoints with gate/up fused (as Phi-3's)
    "Glm4ForCausalLM": "glm4",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",  # Qwen2 without the q/k/v biases, with an RMSNorm on each q and k head
    "Phi3ForCausalLM": "phi3",  # Llama whose checkpoints hold q/k/v and gate/up already fused (Phi-3, Phi-4)
    # (1 + w) norms in float32, a scaled embedding, GeGLU MLPs
    "GemmaForCausalLM": "gemma",
    # Gemma with norms after attention and MLP too, tanh-capped attention and final logits,
    # and a sliding window on every other layer
    "Gemma2ForCausalLM": "gemma2",
    # Gemma 2 without the caps, with q/k norms, and its own RoPE base on the windowed layers
    # (Gemma 3 270M and 1B; the larger ones are multimodal)
    "Gemma3ForCausalLM": "gemma3",
    # Llama with multipliers on the embedding, the residual branches, the softmax and the logits
    "GraniteForCausalLM": "granite",
    # norms after attention and MLP instead of before, and q/k norms over whole projections
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",  # OLMo 2 with windows on three layers of four, RoPE settings per layer kind
    # mixtures of experts: each token's MLP is the weighted sum of its top-k routed experts
    "MixtralForCausalLM": "mixtral",  # Mistral with 8 experts, top-2
    "Qwen2MoeForCausalLM": "qwen2_moe",  # Qwen2 with routed experts and one sigmoid-gated shared expert
    "Qwen3MoeForCausalLM": "qwen3_moe",  # Qwen3 with routed experts
    "GraniteMoeForCausalLM": "granitemoe",  # Granite with routed experts, weighed by a softmax over the top k
    # Granite 4.0: Mamba2 layers among NoPE attention ones, experts beside a shared MLP (or the
    # shared MLP alone: a dense model; every layer attention in Granite 4.0 Micro)
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    # Nemotron-H and Nemotron Nano 2: each layer one part, Mamba2, NoPE attention or a ReLU^2 MLP
    "NemotronHForCausalLM": "nemotron_h",
    # OpenAI's gpt-oss: a learned sink logit per attention head, biased router and experts
    # with a clamped SwiGLU, windows of 128 on every other layer
    "GptOssForCausalLM": "gpt_oss",
    # GLM-4.5, 4.6 and 4.7 (and their Air models): DeepSeek-V3's routing (sigmoid scores with a
    # bias for choosing, expert groups, an always-on shared expert, dense first layers) over
    # Llama's attention with q/k/v biases and RoPE over half of each head; its checkpoints'
    # multi-token-prediction layer is not served
    "Glm4MoeForCausalLM": "glm4_moe",
    # DeepSeek's multi-head latent attention (MLA: keys and values from one small latent per
    # token, which the cache holds) with routed experts: DeepSeek-V2 (softmax routing) and
    # DeepSeek-V3 (V3's routing, as GLM-4.5's), whose architecture R1, V3.1, Kimi K2 and
    # Moonlight share
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite",  # GLM-4.7-Flash: DeepSeek-V3's attention and routing
    # MiniMax-M2 (and M2.1, M2.5): Mixtral's experts on every layer, routed by DeepSeek-V3's
    # sigmoid scores with a bias for choosing (no groups, no shared expert), q and k normed
    # over whole projections (OLMo 2's), RoPE over the first rotary_dim columns of each head
    "MiniMaxM2ForCausalLM": "minimax_m2",
    # Llama 4 (Scout, Maverick): chunked local attention with interleaved RoPE and unit q/k norms
    # on three layers of four, full attention without RoPE (queries scaled by position) on the
    # fourth; one routed expert a token, its router's sigmoid score scaling the expert's input,
    # beside an always-on shared expert
    "Llama4ForCausalLM": "llama4",
    # Qwen3.5 (dense): three layers of four linear attention (Gated DeltaNet, a recurrent state
    # per request instead of a KV cache), the fourth full attention with a sigmoid gate on its
    # output, RoPE over a quarter of each head, (1 + w) norms
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",  # and with Qwen2-MoE's experts (renormalized, a gated shared one)
    # Qwen3-Next: Qwen3.5-MoE's layers before it, its checkpoints' linear projections grouped by key head
    "Qwen3NextForCausalLM": "qwen3_next",
    # the same decoders without an LM head (embedding models such as e5-mistral and
    # gte-Qwen2): they serve embedding requests only
    "LlamaModel": "llama",
    "MistralModel": "mistral",
    "Qwen2Model": "qwen2",
    "Qwen3Model": "qwen3",
    "GemmaModel": "gemma",
    "Gemma2Model": "gemma2",  # bge-multilingual-gemma2
    # the decoders with a classification head on the last token (reward models, classifiers):
    # their "embedding" is the head's logits, one per label
    "LlamaForSequenceClassification": "llama",
    "MistralForSequenceClassification": "mistral",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
}
# image-text (and audio-text) models whose language model genq serves; those of
# worker.core.multimodal's IMAGE_PROCESSORS take images (or audio) too (their encoders load
# apart), the others text alone
TEXT_OF_MULTIMODAL = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",  # Gemma 3 4B, 12B, 27B
    "Mistral3ForConditionalGeneration": "MistralForCausalLM",  # Mistral Small 3.1 and 3.2
    # M-RoPE's three position streams are one for text alone: plain RoPE
    "Qwen2VLForConditionalGeneration": "Qwen2ForCausalLM",  # Qwen2-VL
    "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",  # Qwen2.5-VL
    "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM",  # Qwen3-VL (dense)
    "Qwen3VLMoeForConditionalGeneration": "Qwen3MoeForCausalLM",  # Qwen3-VL-30B-A3B, -235B-A22B
    "Llama4ForConditionalGeneration": "Llama4ForCausalLM",  # Llama 4 Scout and Maverick
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",  # Qwen3.5 (dense)
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",  # Qwen3.5 (experts)
    "Qwen2AudioForConditionalGeneration": "Qwen2ForCausalLM",  # Qwen2-Audio: audio clips, not images
}
_MLA_FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")
_QWEN3_5_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")  # linear and gated full attention
_MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "granitemoe", "gpt_oss", "glm4_moe", "llama4", "qwen3_5_moe",
                 "qwen3_next", "granitemoehybrid", "nemotron_h", "minimax_m2", *_MLA_FAMILIES)
# RoPE variants whose frequencies depend only on the config, not on the sequence length.
SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "longrope"}


# text models that image-text models of one architecture may hold, by their model_type
_TEXT_OF_TYPE = {"ministral3": "Ministral3ForCausalLM"}


def architecture_of(hf_config: Any, default: str = "") -> str:
    """The config's architecture (the first it names), or `default` where it names none."""
    return (getattr(hf_config, "architectures", None) or [default])[0]


def whisper_decoder_config(hf_config: Any) -> Any:
    """The decoder's side of a Whisper config, in the names ModelConfig.from_hf reads (its
    learned positions bound max_model_len)."""
    from transformers import LlamaConfig

    view = LlamaConfig(
        vocab_size=hf_config.vocab_size, hidden_size=hf_config.d_model, intermediate_size=hf_config.decoder_ffn_dim,
        num_hidden_layers=hf_config.decoder_layers, num_attention_heads=hf_config.decoder_attention_heads,
        num_key_value_heads=hf_config.decoder_attention_heads, max_position_embeddings=hf_config.max_target_positions,
        rms_norm_eps=1e-5, tie_word_embeddings=True, eos_token_id=hf_config.eos_token_id,
        bos_token_id=hf_config.decoder_start_token_id, pad_token_id=hf_config.pad_token_id,
    )
    view.architectures = ["WhisperForConditionalGeneration"]
    view.encoder_positions = hf_config.max_source_positions  # the encoder's output length
    return view


def language_config(hf_config: Any) -> Any:
    """The config of the model genq runs: an image-text model's text config (named as its
    causal LM, tied as the whole model is), Whisper's decoder's, else the config itself."""
    arch = architecture_of(hf_config)
    if arch == "WhisperForConditionalGeneration" and hasattr(hf_config, "d_model"):
        return whisper_decoder_config(hf_config)
    if arch not in TEXT_OF_MULTIMODAL:
        return hf_config
    text = copy.deepcopy(hf_config.get_text_config())
    text.architectures = [_TEXT_OF_TYPE.get(getattr(text, "model_type", ""), TEXT_OF_MULTIMODAL[arch])]
    text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))
    for field in ("eos_token_id", "quantization_config"):  # kept on the outer config
        if getattr(hf_config, field, None) is not None and getattr(text, field, None) is None:
            setattr(text, field, getattr(hf_config, field))
    return text


@dataclass(frozen=True)
class MoEConfig:
    """How a mixture-of-experts model routes: each token's router picks `top_k` of
    `num_experts` experts (SwiGLU MLPs of width `intermediate_size`) by softmax probability,
    and the layer's output is their weighted sum."""

    num_experts: int
    top_k: int
    intermediate_size: int
    layers: frozenset[int]  # the layers with experts; the others keep a dense MLP
    renormalize: bool  # scale the top-k probabilities to sum to one (Mixtral; Qwen's norm_topk_prob)
    # Mixtral weighs each expert's output in float32, Qwen in the activation dtype: kept so
    # that outputs equal transformers' on the same weights
    float32_weights: bool
    shared_expert_size: int = 0  # Qwen2-MoE: an always-on expert, scaled by sigmoid(gate(x))
    softmax_after_topk: bool = False  # GraniteMoE: the top k logits' softmax (the same weights, rounded otherwise)
    bias: bool = False  # the router and each expert's projections have biases (gpt-oss)
    # gpt-oss's SwiGLU, (alpha, limit): gate clamped under limit, up within +-limit,
    # (up + 1) * gate * sigmoid(alpha * gate); None: SiLU(gate) * up
    clamped_swiglu: tuple[float, float] | None = None
    # DeepSeek's routers: float32 weights, experts chosen only within the `topk_groups` best of
    # `num_groups` groups, weights scaled by `routed_scaling`. V2 scores by softmax (a group by
    # its best); V3 (GLM-4.5 too) by sigmoid, plus a learned bias where experts are chosen (not
    # where they are weighed), a group scored by its two best
    deepseek_router: bool = False
    sigmoid_scores: bool = False  # (and Llama 4's: the sigmoid of each chosen expert's logit)
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    shared_expert_gated: bool = True  # Qwen2-MoE scales its shared expert by sigmoid(gate(x)); DeepSeek's is plain
    # Llama 4: each chosen expert weighs sigmoid(its logit), and the weight scales the token
    # going into the expert, not what comes out (vLLM's apply_router_weight_on_input)
    weights_on_input: bool = False
    gated: bool = True  # SwiGLU experts; False: up, ReLU^2, down (Nemotron 3's, its shared expert's too)
    latent_size: int = 0  # Nemotron 3 Super: the routed experts' hidden size, projected into and out of
    # expert parallelism (a rank's share, ModelConfig.shard): the experts dealt out whole to
    # this many ranks, num_local_experts each, rank r holding those from r * num_local_experts
    expert_ranks: int = 1

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.expert_ranks

    @classmethod
    def from_hf(cls, hf_config: Any, family: str) -> MoEConfig:
        if family in ("mixtral", "granitemoe", "gpt_oss", "granitemoehybrid"):
            gpt_oss = family == "gpt_oss"
            return cls(num_experts=hf_config.num_local_experts, top_k=hf_config.num_experts_per_tok,
                       intermediate_size=hf_config.intermediate_size,
                       layers=frozenset(range(hf_config.num_hidden_layers)), renormalize=True,
                       float32_weights=family == "mixtral", softmax_after_topk=family != "mixtral",
                       bias=gpt_oss,
                       clamped_swiglu=_clamped_swiglu(hf_config) if gpt_oss else None,
                       # Granite 4.0's shared MLP, added unscaled
                       shared_expert_size=hf_config.shared_intermediate_size if family == "granitemoehybrid" else 0,
                       shared_expert_gated=False)
        if family in ("glm4_moe", *_MLA_FAMILIES):
            return cls._deepseek(hf_config, v3=family != "deepseek_v2")
        if family == "minimax_m2":  # DeepSeek-V3's router in one group, renormalized, unscaled
            return cls(num_experts=hf_config.num_local_experts, top_k=hf_config.num_experts_per_tok,
                       intermediate_size=hf_config.intermediate_size,
                       layers=frozenset(range(hf_config.num_hidden_layers)), renormalize=True,
                       float32_weights=True, deepseek_router=True, sigmoid_scores=True, shared_expert_gated=False)
        if family == "nemotron_h":
            return cls._nemotron_3(hf_config)
        if family == "llama4":  # the shared expert is as wide as a routed one, and ungated
            return cls(num_experts=hf_config.num_local_experts, top_k=hf_config.num_experts_per_tok,
                       intermediate_size=hf_config.intermediate_size, layers=frozenset(hf_config.moe_layers),
                       renormalize=False, float32_weights=False, shared_expert_size=hf_config.intermediate_size,
                       shared_expert_gated=False, sigmoid_scores=True, weights_on_input=True)
        # Qwen: every `decoder_sparse_step`-th layer has experts, unless listed in mlp_only_layers
        step = getattr(hf_config, "decoder_sparse_step", 1) or 1
        dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
        layers = frozenset(i for i in range(hf_config.num_hidden_layers)
                           if i not in dense and (i + 1) % step == 0)
        return cls(num_experts=hf_config.num_experts, top_k=hf_config.num_experts_per_tok,
                   intermediate_size=hf_config.moe_intermediate_size, layers=layers,
                   # Qwen3-VL-MoE's router always renormalizes (its config has no norm_topk_prob)
                   renormalize=bool(getattr(hf_config, "norm_topk_prob", False))
                   or getattr(hf_config, "model_type", None) in ("qwen3_vl_moe_text", "qwen3_5_moe_text"),
                   float32_weights=False,
                   shared_expert_size=getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)

    @classmethod
    def _nemotron_3(cls, hf_config: Any) -> MoEConfig:
        """Nemotron 3: its "moe" layers route as DeepSeek-V3 does (sigmoid scores, a correction
        bias, groups) to experts without a gate, beside one shared expert of its own width;
        Super's routed experts work in `moe_latent_size`."""
        experts, groups = hf_config.n_routed_experts, hf_config.n_group or 1
        _check_expert_groups(experts, groups)
        return cls(num_experts=experts, top_k=hf_config.num_experts_per_tok,
                   intermediate_size=hf_config.moe_intermediate_size,
                   layers=frozenset(i for i, kind in enumerate(hf_config.layers_block_type) if kind == "moe"),
                   renormalize=bool(hf_config.norm_topk_prob), float32_weights=True,
                   shared_expert_size=hf_config.moe_shared_expert_intermediate_size, deepseek_router=True,
                   sigmoid_scores=True, num_groups=groups, topk_groups=hf_config.topk_group or 1,
                   routed_scaling=float(hf_config.routed_scaling_factor), shared_expert_gated=False, gated=False,
                   latent_size=getattr(hf_config, "moe_latent_size", None) or 0)

    @classmethod
    def _deepseek(cls, hf_config: Any, v3: bool) -> MoEConfig:
        """The first `first_k_dense_replace` layers keep a dense MLP (GLM-4.7-Flash: those
        `mlp_layer_types` does not call sparse); `n_shared_experts` experts' worth of
        always-on MLP joins the routed ones. V2 groups experts only with `topk_method`
        group_limited_greedy, and never renormalizes (as transformers)."""
        experts = hf_config.n_routed_experts
        kinds = getattr(hf_config, "mlp_layer_types", None)
        layers = (frozenset(i for i, kind in enumerate(kinds) if kind == "sparse") if kinds
                  else frozenset(range(hf_config.first_k_dense_replace, hf_config.num_hidden_layers)))
        grouped = v3 or getattr(hf_config, "topk_method", "greedy") == "group_limited_greedy"
        groups = (hf_config.n_group or 1) if grouped else 1
        _check_expert_groups(experts, groups)
        return cls(num_experts=experts, top_k=hf_config.num_experts_per_tok,
                   intermediate_size=hf_config.moe_intermediate_size,
                   layers=layers, renormalize=v3 and bool(hf_config.norm_topk_prob), float32_weights=True,
                   shared_expert_size=hf_config.moe_intermediate_size * (hf_config.n_shared_experts or 0),
                   deepseek_router=True, sigmoid_scores=v3, num_groups=groups,
                   topk_groups=(hf_config.topk_group or 1) if grouped else 1,
                   routed_scaling=float(hf_config.routed_scaling_factor), shared_expert_gated=False)


# the checkpoint's modules of each kind of layer _check_quantized_split names, within a layer
_LAYER_MODULES = {"q_proj": ("self_attn.q_proj",), "k_proj and v_proj": ("self_attn.k_proj", "self_attn.v_proj"),
                  "o_proj": ("self_attn.o_proj",), "gate_proj and up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                  "down_proj": ("mlp.down_proj",)}


def _float_in_every_layer(cfg: ModelConfig, layers: str) -> bool:
    """Whether the quantized checkpoint keeps `layers` (_LAYER_MODULES' name) float in every
    decoder layer (NVIDIA's FP8 checkpoints keep attention so, say)."""
    assert cfg.quant is not None
    modules = _LAYER_MODULES.get(layers)
    return modules is not None and all(cfg.quant.skips([f"model.layers.{i}.{module}"])
                                       for i in range(cfg.num_hidden_layers) for module in modules)


def _check_expert_groups(experts: int, groups: int) -> None:
    if experts % groups or experts // groups < 2:
        raise ValueError(f"n_group={groups} does not split n_routed_experts={experts} into groups "
                         "of at least two experts")


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention. Each token's keys and values come from one
    latent of `kv_lora_rank` (normalized) and one RoPE key of `qk_rope_head_dim` shared by
    every head, which is all the cache holds; queries come from `q_lora_rank` (None: straight
    from the hidden state). A head's key is [nope | rope] (`qk_nope_head_dim` +
    `qk_rope_head_dim`), its value `v_head_dim` wide."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    interleaved_rope: bool  # the RoPE columns come as interleaved pairs (V2; V3's rope_interleave)

    @classmethod
    def from_hf(cls, hf_config: Any, family: str) -> MLAConfig:
        return cls(q_lora_rank=hf_config.q_lora_rank or None, kv_lora_rank=hf_config.kv_lora_rank,
                   qk_nope_head_dim=hf_config.qk_nope_head_dim, qk_rope_head_dim=hf_config.qk_rope_head_dim,
                   v_head_dim=hf_config.v_head_dim,
                   interleaved_rope=family == "deepseek_v2" or bool(getattr(hf_config, "rope_interleave", True)))

    def softmax_scale(self, hf_config: Any) -> float:
        """1 / sqrt(nope + rope), times YaRN's mscale squared where mscale_all_dim is set."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        params = _rope_params(hf_config)
        factor, all_dim = float(params.get("factor", 1.0)), float(params.get("mscale_all_dim", 0) or 0)
        if (params.get("rope_type") or params.get("type") or "default") != "default" and all_dim and factor > 1:
            scale *= (0.1 * all_dim * math.log(factor) + 1.0) ** 2
        return scale


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The shape of the layers that keep a state per request (worker.model_executor.models.linear_attention):
    Gated DeltaNet's (Qwen3.5's linear attention), q and k of `num_key_heads` heads, v of
    `num_value_heads` (a multiple), a causal convolution of `conv_kernel` taps over the three;
    or Mamba2's (`mamba2`), whose B and C stand for k and q (`num_key_heads` groups of
    `key_head_dim`, the state size) and x for v (`num_value_heads` heads of `value_head_dim`)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    mamba2: bool = False
    conv_bias: bool = False  # Mamba2's convolution and projections may have biases
    proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, math.inf)  # Mamba2's time steps are clamped to this

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    @classmethod
    def from_hf(cls, hf_config: Any) -> LinearAttentionConfig:
        cfg = cls(hf_config.linear_num_key_heads, hf_config.linear_num_value_heads, hf_config.linear_key_head_dim,
                  hf_config.linear_value_head_dim, hf_config.linear_conv_kernel_dim)
        if cfg.num_value_heads % cfg.num_key_heads:
            raise ValueError(f"linear_num_value_heads ({cfg.num_value_heads}) is not a multiple of "
                             f"linear_num_key_heads ({cfg.num_key_heads})")
        return cfg

    @classmethod
    def of_mamba2(cls, hf_config: Any) -> LinearAttentionConfig:
        """Granite 4.0's Mamba2 settings, or Nemotron-H's (named otherwise; time steps at least
        time_step_min)."""
        if hasattr(hf_config, "mamba_num_heads"):  # Nemotron-H
            cfg = cls(hf_config.n_groups, hf_config.mamba_num_heads, hf_config.ssm_state_size, hf_config.mamba_head_dim,
                      hf_config.conv_kernel, mamba2=True, conv_bias=bool(hf_config.use_conv_bias),
                      proj_bias=bool(hf_config.use_bias), dt_limit=(float(hf_config.time_step_min), math.inf))
        else:
            act = getattr(hf_config, "hidden_act", "silu")
            if act != "silu":
                raise ValueError(f"unsupported Mamba2 activation {act!r}; supported: silu")
            limit = tuple(getattr(hf_config, "time_step_limit", None) or (0.0, math.inf))
            cfg = cls(hf_config.mamba_n_groups, hf_config.mamba_n_heads, hf_config.mamba_d_state, hf_config.mamba_d_head,
                      hf_config.mamba_d_conv, mamba2=True, conv_bias=bool(hf_config.mamba_conv_bias),
                      proj_bias=bool(hf_config.mamba_proj_bias), dt_limit=(float(limit[0]), float(limit[1])))
        if cfg.num_value_heads % cfg.num_key_heads:
            raise ValueError(f"Mamba2's {cfg.num_value_heads} heads do not split into its {cfg.num_key_heads} groups")
        return cfg


@dataclass(frozen=True)
class Chunked:
    """Chunked local attention (Llama 4's): the positions are cut into chunks of `size`, and a
    query sees those of its own chunk up to itself."""

    size: int

    def first_seen(self, position: int) -> int:
        return position // self.size * self.size


# what a layer's queries see before them: the last `window` positions (an int), their chunk,
# or every position (None)
Span = int | Chunked | None


@dataclass(frozen=True)
class QueryScale:
    """Llama 4's attention temperature: queries are scaled by
    1 + beta * log(1 + floor((position + offset) / length)) after their rotation, on the NoPE
    layers alone where `nope_only` (Llama 4; Ministral 3 scales every layer's). `rounded`: the
    scale is rounded to the model's dtype before the product (Ministral 3), else the product
    is taken in float32 and rounded (Llama 4), as transformers does each."""

    beta: float
    length: int
    offset: int = 0
    nope_only: bool = False
    rounded: bool = True


@dataclass(frozen=True)
class ModelConfig:
    hf_config: Any  # transformers.PretrainedConfig
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2)
    o_proj_bias: bool
    mlp_bias: bool
    eos_token_ids: frozenset[int]
    has_lm_head: bool = True  # False: an embedding model; generation is refused
    labels: tuple[str, ...] = ()  # a classification model's labels, one per logit of its score head
    qk_norm: bool = False  # an RMSNorm over each q and k head before the rotary (Qwen3)
    moe: MoEConfig | None = None  # a mixture of experts' routing, None for a dense model
    # per layer, how many positions back (itself included) a query sees; None: all of them
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"  # the MLP's gate activation: silu, or gelu_pytorch_tanh (Gemma)
    # RMSNorms scale by (offset + weight) in float32 before rounding (Gemma: 1, OLMo 2: 0);
    # None: Llama's, which round first
    norm_weight_offset: float | None = None
    post_norms_only: bool = False  # OLMo 2: no norm before attention or MLP, one after each
    qk_norm_whole: bool = False  # OLMo 2: the q/k norms span all heads of the projection, not one head
    embed_scale: float | None = None  # the embedding is multiplied by this (Gemma: sqrt(hidden))
    # and so are input states given in place of tokens' (Granite's embedding_multiplier scales
    # transformers' inputs_embeds; Gemma's scale is its embedding's own)
    embed_scale_given: bool = False
    residual_scale: float | None = None  # attention's and the MLP's outputs are, before the residual add
    logits_divisor: float | None = None  # the final logits are divided by this (Granite's logits_scaling)
    sandwich_norms: bool = False  # a norm after attention and one after the MLP as well (Gemma2)
    attn_scale: float | None = None  # softmax scale when not head_dim ** -0.5 (Gemma2's query_pre_attn_scalar)
    attn_softcap: float | None = None  # attention scores become cap * tanh(score / cap)
    final_softcap: float | None = None  # and so do the final logits
    local_rope: bool = False  # windowed layers rotate by RoPE settings of their own (Gemma 3)
    rotary_dim: int | None = None  # RoPE rotates each head's first rotary_dim columns (Phi-4-mini: 3/4); None: all
    long_rope: bool = False  # LongRoPE (Phi-3.5, Phi-4-mini): its long factors, not its short ones
    attn_sinks: bool = False  # a learned logit per head joins its softmax, with no value (gpt-oss)
    nope_layers: frozenset[int] = frozenset()  # layers that attend without RoPE (SmolLM3's NoPE)
    query_scale: QueryScale | None = None  # Llama 4's attention temperature (and Ministral 3's)
    # Llama 4: the layers of chunked local attention, and their chunk (their KV is kept as a
    # window as wide as the chunk would keep it)
    chunked_layers: frozenset[int] = frozenset()
    attention_chunk_size: int | None = None
    unit_qk_norm: bool = False  # Llama 4: each rotated q and k head scaled to unit RMS (no weight), after RoPE
    # Qwen3.5: the layers of linear attention (a state per request, no KV cache), and its shape
    linear_layers: frozenset[int] = frozenset()
    linear: LinearAttentionConfig | None = None
    attn_output_gate: bool = False  # Qwen3.5: q_proj gives each head a gate too; the output is scaled by its sigmoid
    # Nemotron-H: each layer is one part after its norm: these layers an MLP alone, the others
    # their attention or Mamba2 alone
    mlp_only_layers: frozenset[int] = frozenset()
    one_part_layers: bool = False
    # RoPE rotates pairs (2i, 2i + 1) of each head, not (i, i + d/2) (Ernie 4.5): q and k's
    # rows are permuted at load so that the half-split rotation computes the same scores
    interleaved_rope: bool = False
    # M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): each head's rotary pairs in sections, rotated by the temporal,
    # height and width positions in turn; text alone has the three equal (plain RoPE)
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False  # Qwen3-VL: the streams take turns over the pairs, not sections of them
    quant: QuantConfig | None = None  # quantized weights: the checkpoint's, or fp8 quantized as they load
    # the checkpoint's fp8 KV-cache scales, per tensor or attn_head (worker.model_executor.models.kv_scales)
    kv_cache_scheme: str | None = None
    # multi-head latent attention (DeepSeek): the cache holds one head (num_key_value_heads 1)
    # of head_dim = kv_lora_rank + qk_rope_head_dim columns, keys and values alike
    mla: MLAConfig | None = None

    @classmethod
    def from_hf(cls, hf_config: Any, quantization: str | None = None, max_model_len: int | None = None
                ) -> ModelConfig:
        """`quantization`: the engine's argument (fp8, or None: as the checkpoint is stored);
        `max_model_len`: the longest sequence the engine serves (None: the model's limit)."""
        arch = architecture_of(hf_config, "LlamaForCausalLM")
        if arch not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            raise ValueError(f"unsupported architecture {arch!r}; supported: {supported}")
        heads = hf_config.num_attention_heads
        family = SUPPORTED_ARCHITECTURES[arch]
        qwen2 = family in ("qwen2", "qwen2_moe")
        has_lm_head = arch.endswith("ForCausalLM") or family == "whisper"
        any_bias = bool(getattr(hf_config, "use_bias", False))  # Ernie 4.5: every projection's
        qkv_bias = bool(getattr(hf_config, "attention_bias", False)) or qwen2 or any_bias
        # Qwen2's and GLM-4's biases are q/k/v's alone; Seed-OSS switches o's apart
        o_bias = (bool(getattr(hf_config, "attention_out_bias", getattr(hf_config, "attention_bias", False)))
                  and not qwen2 and family not in ("glm4", "glm4_moe"))
        window = getattr(hf_config, "sliding_window", None)
        if family.startswith("qwen") and not getattr(hf_config, "use_sliding_window", False):
            window = None
        # transformers >= 5 names each layer's kind (Qwen2's max_window_layers, Gemma's
        # alternation); without that list, a window applies to every layer (Mistral, Phi-3)
        layer_types = getattr(hf_config, "layer_types", None) or ["sliding_attention"] * hf_config.num_hidden_layers
        layer_windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
        chunked = frozenset(i for i, kind in enumerate(layer_types) if kind == "chunked_attention")
        chunk = getattr(hf_config, "attention_chunk_size", None) if chunked else None
        if chunked and not (isinstance(chunk, int) and chunk > 0):
            raise ValueError(f"layers {sorted(chunked)} are chunked_attention, but attention_chunk_size is {chunk!r}")
        for kind in _ROPE_KINDS:
            _rope_type(hf_config, kind)  # fail early on unsupported scaling
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        cfg = cls(
            hf_config=hf_config,
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            # Llama 4's dense layers are wider than its experts
            intermediate_size=_dense_intermediate_size(hf_config, family),
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=getattr(hf_config, "rms_norm_eps", None) or hf_config.layer_norm_epsilon,
            max_position_embeddings=hf_config.max_position_embeddings,
            # no head of its own: the embedding stands in (logits are never asked of it)
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)) or not has_lm_head,
            attention_bias=qkv_bias,
            o_proj_bias=o_bias or any_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)) or any_bias,
            interleaved_rope=family in ("ernie4_5", "glm4", "llama4"),
            layer_windows=layer_windows,
            chunked_layers=chunked,
            attention_chunk_size=chunk,
            eos_token_ids=_eos_ids(hf_config),
            has_lm_head=has_lm_head,
            labels=_labels(hf_config) if arch.endswith("ForSequenceClassification") else (),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3", "olmo2", "olmo3", "minimax_m2", *_QWEN3_5_FAMILIES)
            or (family == "glm4_moe" and bool(hf_config.use_qk_norm)),
            moe=MoEConfig.from_hf(hf_config, family) if _has_experts(hf_config, family) else None,
            quant=QuantConfig.from_hf(hf_config, quantization),
            kv_cache_scheme=kv_cache_scheme(hf_config),
            rotary_dim=_rotary_dim(hf_config, head_dim),
            long_rope=_long_rope(hf_config, max_model_len),
            mrope_section=_mrope_section(hf_config),
            mrope_interleaved=getattr(hf_config, "model_type", None) in _INTERLEAVED_MROPE,
            **_variant_fields(hf_config, family),
        )
        return cfg._with_mla(family) if family in _MLA_FAMILIES else cfg

    def _with_mla(self, family: str) -> ModelConfig:
        """The cache's one head of latent and RoPE key; RoPE over the query's and key's RoPE
        columns alone."""
        mla = MLAConfig.from_hf(self.hf_config, family)
        return dataclasses.replace(self, mla=mla, num_key_value_heads=1, head_dim=mla.kv_lora_rank + mla.qk_rope_head_dim,
                                   rotary_dim=mla.qk_rope_head_dim, attn_scale=mla.softmax_scale(self.hf_config))

    def shard(self, world_size: int, expert_parallel: bool = False) -> ModelConfig:
        """A tensor-parallel rank's share of the model (worker.model_executor.tensor_parallel): 1/world_size of its
        attention heads, key-value heads and MLP features (`expert_parallel`: of its experts,
        whole, beside a share of the shared expert's features); ValueError naming what does not
        split."""
        if world_size == 1:
            return self
        moe, linear = self.moe, self.linear
        if self.quant is not None and self.quant.act_order:
            raise ValueError(f"tensor_parallel_size={world_size} cannot split {self.architecture} yet: "
                             "its act-order (desc_act) GPTQ weights run on one device only")
        kv_heads = self.num_key_value_heads
        if kv_heads < world_size and world_size % kv_heads == 0:  # each rank keeps the one KV head its
            kv_heads = world_size  # query heads read, as vLLM replicates them (world_size / kv ranks a head)
        sizes = {"num_attention_heads": self.num_attention_heads, "num_key_value_heads": kv_heads,
                 "intermediate_size": self.intermediate_size}
        if moe is not None:  # each expert (and the shared one) split as a dense MLP is, or dealt out whole
            sizes.update({"the shared expert's intermediate_size": moe.shared_expert_size,
                          **({"num_experts": moe.num_experts} if expert_parallel else
                             {"the experts' intermediate_size": moe.intermediate_size})})
        if linear is not None:  # the layers with a state: their heads (Mamba2's B and C: its groups)
            keys, values = (("Mamba2's n_groups", "Mamba2's heads") if linear.mamba2 else
                            ("linear_num_key_heads", "linear_num_value_heads"))
            sizes.update({keys: linear.num_key_heads, values: linear.num_value_heads})
        for name, size in sizes.items():
            if size % world_size:
                nor = ", nor does it divide it" if name == "num_key_value_heads" else ""
                raise ValueError(f"{name} ({size}) is not divisible by tensor_parallel_size ({world_size}){nor}")
        if self.quant is not None:
            self._check_quantized_split(world_size, kv_heads, expert_parallel)
        if moe is not None:
            moe = dataclasses.replace(moe, shared_expert_size=moe.shared_expert_size // world_size,
                                      expert_ranks=world_size if expert_parallel else 1,
                                      intermediate_size=moe.intermediate_size // (1 if expert_parallel else world_size))
        if linear is not None:
            linear = dataclasses.replace(linear, num_key_heads=linear.num_key_heads // world_size,
                                         num_value_heads=linear.num_value_heads // world_size)
        return dataclasses.replace(self, num_attention_heads=self.num_attention_heads // world_size,
                                   num_key_value_heads=kv_heads // world_size,
                                   intermediate_size=self.intermediate_size // world_size, moe=moe, linear=linear)

    def _check_quantized_split(self, world_size: int, kv_heads: int, expert_parallel: bool) -> None:
        """A quantized layer splits at whole blocks of its scales: each rank's rows of a layer
        split by rows are whole blocks of rows, and its columns of a layer split by columns
        whole groups of columns (or all of them lie in one) and, packed eight to a word (int4),
        whole words (experts dealt out whole always are). ValueError naming the first that
        does not, as vLLM refuses it."""
        assert self.quant is not None
        block_rows, block_cols = self.quant.block or (1, 1)
        moe, mla = self.moe, self.mla
        heads = self.num_attention_heads * (mla.v_head_dim if mla is not None else self.head_dim)
        rows = {"q_proj": self.num_attention_heads * self.head_dim, "k_proj and v_proj": kv_heads * self.head_dim,
                "gate_proj and up_proj": self.intermediate_size}
        columns = {"o_proj": heads, "down_proj": self.intermediate_size}
        if mla is not None:  # its up-projections are widened as they load: only o_proj stays quantized
            del rows["q_proj"], rows["k_proj and v_proj"]
        if self.quant.experts_only:  # gpt-oss's MXFP4: the experts alone are quantized
            rows, columns = {}, {}
        if moe is not None:
            if not expert_parallel:
                rows["the experts' gate_proj and up_proj"] = columns["the experts' down_proj"] = moe.intermediate_size
            if moe.shared_expert_size:
                rows["the shared expert's gate_proj and up_proj"] = moe.shared_expert_size
                columns["the shared expert's down_proj"] = moe.shared_expert_size
        for table in (rows, columns):  # what every layer keeps float splits as a float layer does
            for layers in [name for name in table if _float_in_every_layer(self, name)]:
                del table[layers]
        for layers, size in rows.items():
            if size // world_size % block_rows:
                hint = " (enable_expert_parallel keeps each expert whole)" if "experts'" in layers else ""
                raise ValueError(f"tensor_parallel_size={world_size} leaves {size // world_size} output rows of "
                                 f"{layers} on each rank, not whole blocks of the checkpoint's {block_rows} rows "
                                 f"a scale{hint}")
        for layers, size in columns.items():
            share = size // world_size
            if size > block_cols and share % block_cols:
                fp4 = ("; or quantization='fp8', which widens the MXFP4 experts as they load and quantizes them "
                       "again, a scale per output channel, which splits anywhere" if self.quant.kind == "fp4" else "")
                hint = f" (enable_expert_parallel keeps each expert whole{fp4})" if "experts'" in layers else ""
                raise ValueError(f"tensor_parallel_size={world_size} leaves {share} input columns of {layers} on "
                                 f"each rank, not whole groups of the checkpoint's {block_cols} columns a scale{hint}")
            if self.quant.kind == "int4" and share % 8:
                raise ValueError(f"tensor_parallel_size={world_size} leaves {share} input columns of {layers} on "
                                 "each rank, not whole words of eight int4 values")

    def layer_span(self, index: int) -> Span:
        """What layer `index`'s queries see before them."""
        if index in self.chunked_layers:
            assert self.attention_chunk_size is not None
            return Chunked(self.attention_chunk_size)
        return self.layer_windows[index] if self.layer_windows else None

    @property
    def kept_windows(self) -> tuple[int | None, ...]:
        """Per layer, how far back its queries read, for the blocks the cache keeps
        (worker.config.kv_group_layout): a window's width, or a chunk's size (a query reads
        from its chunk's start, never more than that many positions back), or None: all."""
        spans = (self.layer_span(i) for i in range(self.num_hidden_layers))
        return tuple(span.size if isinstance(span, Chunked) else span for span in spans)

    @property
    def kv_pools(self) -> int:
        """Cache pools a layer holds: K and V, or one where latent attention's keys are its values."""
        return 1 if self.mla is not None else 2

    def rope_inv_freq(self, kind: str = "full_attention") -> tuple[torch.Tensor, float]:
        """Inverse frequencies [head_dim / 2] and the attention scaling of the RoPE variant of
        the layers of `kind` (full_attention, or sliding_attention where local_rope)."""
        rope_type = _rope_type(self.hf_config, kind)
        theta = float(
            _rope_params(self.hf_config, kind).get("rope_theta")
            or getattr(self.hf_config, "rope_theta", None)
            or 10000.0
        )
        if rope_type == "default":
            dim = self.rotary_dim or self.head_dim
            exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
            return 1.0 / (theta**exponents), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        extra: dict[str, Any] = {"layer_type": kind} if _per_kind(self.hf_config) else {}
        if rope_type == "longrope" and self.long_rope:  # a length past the original picks the long factors
            extra["seq_len"] = _original_max_positions(self.hf_config) + 1
        return ROPE_INIT_FUNCTIONS[rope_type](self.hf_config, "cpu", **extra)


def _has_experts(hf_config: Any, family: str) -> bool:
    """Granite 4.0's dense models (num_local_experts 0) are of its experts' architecture, as
    Nemotron-H's (without "moe" layers) are of Nemotron 3's."""
    if family == "nemotron_h":
        return "moe" in hf_config.layers_block_type
    return family in _MOE_FAMILIES and (family != "granitemoehybrid" or hf_config.num_local_experts > 0)


# gpt-oss's clamped SwiGLU: OpenAI's config.json names neither, nor does transformers'
# GptOssConfig until a late 5.x (5.17's model code held them; 5.24's config has them)
_GPT_OSS_SWIGLU = (1.702, 7.0)  # (alpha, limit)


def _clamped_swiglu(hf_config: Any) -> tuple[float, float]:
    alpha, limit = _GPT_OSS_SWIGLU
    return getattr(hf_config, "swiglu_alpha", alpha), getattr(hf_config, "swiglu_limit", limit)


def _dense_intermediate_size(hf_config: Any, family: str) -> int:
    """The dense MLPs' width: Llama 4's are wider than its experts; Qwen3.5-MoE has none (its
    experts' width stands in); Granite 4.0's dense models have their shared MLP."""
    if family == "llama4":
        return hf_config.intermediate_size_mlp
    if family == "granitemoehybrid":
        return hf_config.shared_intermediate_size
    return getattr(hf_config, "intermediate_size", None) or hf_config.moe_intermediate_size


def _labels(hf_config: Any) -> tuple[str, ...]:
    id2label = getattr(hf_config, "id2label", None) or {}
    return tuple(str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(hf_config.num_labels))


_GELUS = ("gelu_pytorch_tanh", "gelu")


def _variant_fields(hf_config: Any, family: str) -> dict[str, Any]:
    """What Gemma's, Granite's and OLMo 2's layers do beyond Llama's."""
    if family.startswith("gemma"):
        return _gemma_fields(hf_config, family)
    if family == "nemotron_h":
        return _nemotron_h_fields(hf_config)
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported MLP activation {act!r}; supported: silu")
    if family in ("olmo2", "olmo3"):
        return dict(norm_weight_offset=0.0, post_norms_only=True, qk_norm_whole=True, local_rope=_per_kind(hf_config))
    if family == "minimax_m2":
        return _minimax_m2_fields(hf_config)
    if family == "ministral3":
        params = _rope_params(hf_config)
        return dict(query_scale=QueryScale(float(params["llama_4_scaling_beta"]),
                                           int(params["original_max_position_embeddings"])))
    if family == "llama4":  # no_rope_layers: 1 where the layer rotates, 0 where it does not
        nope = frozenset(i for i, rotates in enumerate(hf_config.no_rope_layers) if not rotates)
        scale = (QueryScale(float(hf_config.attn_scale), int(hf_config.floor_scale), offset=1, nope_only=True,
                            rounded=False) if hf_config.attn_temperature_tuning else None)
        return dict(nope_layers=nope, query_scale=scale, unit_qk_norm=bool(hf_config.use_qk_norm))
    if family == "glm4":  # a norm after attention and one after the MLP too, as Gemma 2
        return dict(sandwich_norms=True)
    if family == "smollm3":  # no_rope_layers: 1 where the layer rotates, 0 where it does not
        return dict(nope_layers=frozenset(i for i, rotates in enumerate(hf_config.no_rope_layers) if not rotates))
    if family in _QWEN3_5_FAMILIES:  # (1 + w) norms in float32, Gemma's
        linear = frozenset(i for i, kind in enumerate(hf_config.layer_types) if kind == "linear_attention")
        return dict(norm_weight_offset=1.0, attn_output_gate=True, linear_layers=linear,  # (none: an MTP layer's model)
                    linear=LinearAttentionConfig.from_hf(hf_config) if linear else None)
    if family == "gpt_oss":  # norms scale in float32 (their weights are kept so), then round
        return dict(norm_weight_offset=0.0, attn_sinks=True)
    if family.startswith("granite"):
        fields = dict(embed_scale=hf_config.embedding_multiplier, embed_scale_given=True,
                      residual_scale=hf_config.residual_multiplier,
                      attn_scale=hf_config.attention_multiplier, logits_divisor=hf_config.logits_scaling)
        return {**fields, **_granite_4_fields(hf_config)} if family == "granitemoehybrid" else fields
    return {}


# what MiniMax-M2's checkpoints may say of themselves, and the one value genq (as transformers)
# runs: another is a model of another kind, refused by name rather than run wrongly
_MINIMAX_M2_AS_RUN = {"use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
                      "use_routing_bias": True, "shared_intermediate_size": 0}


def _minimax_m2_fields(hf_config: Any) -> dict[str, Any]:
    """MiniMax-M2's q and k norms over whole projections. Its checkpoints' config carries
    fields from MiniMax-Text-01 that transformers' MiniMaxM2 does not read: values other than
    M2's (lightning attention layers, per-head norms, softmax routing, a shared expert) would
    mean a model genq does not run."""
    for name, value in _MINIMAX_M2_AS_RUN.items():
        given = getattr(hf_config, name, value)
        if given != value:
            raise ValueError(f"MiniMax-M2 checkpoints with {name}={given!r} are not supported; "
                             f"genq runs {name}={value!r}, as transformers does")
    lightning = [i for i, kind in enumerate(getattr(hf_config, "attn_type_list", None) or ()) if kind != 1]
    if lightning:
        raise ValueError(f"attn_type_list makes layers {lightning} lightning (linear) attention, MiniMax-Text-01's, "
                         "which genq does not run; MiniMax-M2's layers are all full attention (1)")
    return dict(qk_norm_whole=True)


def _granite_4_fields(hf_config: Any) -> dict[str, Any]:
    """Granite 4.0's Mamba2 layers ("mamba" in older configs), and attention without RoPE
    unless position_embedding_type asks for it."""
    kinds = hf_config.layer_types
    mamba = frozenset(i for i, kind in enumerate(kinds) if kind in ("linear_attention", "mamba"))
    rotates = getattr(hf_config, "position_embedding_type", None) == "rope"
    fields: dict[str, Any] = dict(nope_layers=frozenset() if rotates else frozenset(range(len(kinds))) - mamba)
    if mamba:  # (Granite-4.0-Micro's layers are all attention: a plain transformer)
        fields.update(linear=LinearAttentionConfig.of_mamba2(hf_config), linear_layers=mamba)
    return fields


def _nemotron_h_fields(hf_config: Any) -> dict[str, Any]:
    """Nemotron-H's layers, each one part: Mamba2, attention without RoPE, or an MLP of
    ReLU^2 without a gate (Nemotron 3: or experts, `MoEConfig.layers`); norms that scale in
    float32, then round."""
    kinds = list(hf_config.layers_block_type)
    if "moe" in kinds and hf_config.mlp_bias:
        raise ValueError("Nemotron 3's expert layers with mlp_bias=True are not supported (its checkpoints have "
                         "none)")
    for name, act in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if getattr(hf_config, name, act) != act:
            raise ValueError(f"unsupported {name} {getattr(hf_config, name)!r}; supported: {act}")
    mamba = frozenset(i for i, kind in enumerate(kinds) if kind == "linear_attention")
    attention = frozenset(i for i, kind in enumerate(kinds) if kind == "full_attention")
    mlp = frozenset(i for i, kind in enumerate(kinds) if kind == "mlp")
    return dict(hidden_act="relu2", norm_weight_offset=0.0, linear=LinearAttentionConfig.of_mamba2(hf_config),
                linear_layers=mamba, mlp_only_layers=mlp, one_part_layers=True, nope_layers=attention)


def _gemma_fields(hf_config: Any, family: str) -> dict[str, Any]:
    # the activation transformers applies: Gemma2's hidden_activation, Gemma's hidden_act
    act = getattr(hf_config, "hidden_act" if family == "gemma" else "hidden_activation", None)
    if act not in _GELUS:
        raise ValueError(f"unsupported MLP activation {act!r}; supported: {', '.join(_GELUS)}")
    fields: dict[str, Any] = dict(hidden_act=act, norm_weight_offset=1.0, embed_scale=hf_config.hidden_size**0.5)
    if family in ("gemma2", "gemma3"):
        fields.update(sandwich_norms=True, attn_scale=hf_config.query_pre_attn_scalar**-0.5,
                      attn_softcap=getattr(hf_config, "attn_logit_softcapping", None),
                      final_softcap=getattr(hf_config, "final_logit_softcapping", None),
                      local_rope=_per_kind(hf_config))
    return fields


# the layer kinds of transformers' layer_types, which may each have RoPE settings of their own
_ROPE_KINDS = ("full_attention", "sliding_attention")


def _per_kind(hf_config: Any) -> bool:
    """Whether the RoPE settings are given per layer kind (Gemma 3)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return isinstance(params.get("full_attention"), dict)


def _rope_params(hf_config: Any, kind: str = "full_attention") -> dict:
    # transformers >= 5 keeps RoPE settings in `rope_parameters` (per layer kind, for Gemma
    # 3); older ones in `rope_scaling`.
    if _per_kind(hf_config):
        return dict(hf_config.rope_parameters.get(kind) or hf_config.rope_parameters["full_attention"])
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    return dict(params or {})


# the text configs of image-text models whose prompts place images by M-RoPE
_MROPE_MODEL_TYPES = ("qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text", "qwen3_vl_moe_text", "qwen3_5_text",
                      "qwen3_5_moe_text")
_INTERLEAVED_MROPE = ("qwen3_vl_text", "qwen3_vl_moe_text", "qwen3_5_text", "qwen3_5_moe_text")


def _mrope_section(hf_config: Any) -> tuple[int, ...] | None:
    """M-RoPE's sections (rotary pairs per position stream) of Qwen2-VL, Qwen2.5-VL and
    Qwen3-VL. For text alone the three streams are equal and M-RoPE is plain RoPE."""
    section = _rope_params(hf_config).get("mrope_section")
    if not section or getattr(hf_config, "model_type", None) not in _MROPE_MODEL_TYPES:
        return None
    return tuple(int(n) for n in section)


def _rotary_dim(hf_config: Any, head_dim: int) -> int | None:
    partial = _rope_params(hf_config).get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial in (None, 1, 1.0):
        return None
    dim = int(head_dim * partial)  # as transformers rounds it
    if not 0 < dim <= head_dim or dim % 2:
        raise ValueError(f"partial_rotary_factor={partial} rotates {dim} of {head_dim} columns per head; "
                         "it must be an even number of them, at least 2")
    return dim


def _original_max_positions(hf_config: Any) -> int:
    return int(_rope_params(hf_config).get("original_max_position_embeddings")
               or getattr(hf_config, "original_max_position_embeddings", None)
               or hf_config.max_position_embeddings)


def _long_rope(hf_config: Any, max_model_len: int | None) -> bool:
    """Whether a LongRoPE model rotates by its long factors. transformers switches per forward
    pass by the sequence's length, so a sequence that grows past the original length would hold
    keys rotated both ways; the engine picks one set for every sequence instead, as vLLM does:
    the long factors when it serves sequences longer than the original length (Phi-3.5-mini's
    4096; `max_model_len` at or under it keeps the short ones)."""
    if _rope_type(hf_config) != "longrope":
        return False
    return (max_model_len or hf_config.max_position_embeddings) > _original_max_positions(hf_config)


def _rope_type(hf_config: Any, kind: str = "full_attention") -> str:
    params = _rope_params(hf_config, kind)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling {rope_type!r}; supported: {', '.join(sorted(SUPPORTED_ROPE_TYPES))}"
        )
    return rope_type


def _eos_ids(hf_config: Any) -> frozenset[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])
