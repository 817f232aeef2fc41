"""Fixtures shared by every test package: one real Redis server on loopback per session, and
tiny random models of each supported family (saved as Hugging Face directories) beside the
default model, converted once into a cache shared across runs.

`redis_url` hands each test an empty database; tests never touch a server they did not start.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from safetensors.torch import load_file, save_file

from producer.redis_server import RedisServer

# Triton reads this when kernels are defined: set it before anything imports `kernels`, so the
# kernel tests run in the interpreter on machines without a GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test` runs two processes), each process gets its share of the cores:
# torch's threads would otherwise contend for them and spin.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """URL of the session's server, flushed before each test so tests cannot see each other."""
    conn = redis.Redis.from_url(redis_server.url)
    conn.flushall()
    conn.close()
    yield redis_server.url


@pytest.fixture
def redis_conn(redis_url: str) -> Iterator[redis.Redis]:
    """A plain redis-py connection (bytes replies) to the test database."""
    conn = redis.Redis.from_url(redis_url)
    yield conn
    conn.close()


# -- models ---------------------------------------------------------------------------------

CACHE_DIR = Path(os.environ.get("GENQ_TEST_CACHE", Path.home() / ".cache" / "genq"))

TINY_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.3,  # peaky logits, so greedy choices are not near-ties
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


VOCAB = 49152  # the default tokenizer's vocabulary, so prompts can be text
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")  # latent attention (tiny_deepseek_config)


def tiny_hf_config(family: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    vocab = VOCAB
    if family == "llama":
        return LlamaConfig(vocab_size=vocab, tie_word_embeddings=False, rope_theta=10000.0, **TINY_COMMON)
    if family == "llama3_rope":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 500000.0}
        return LlamaConfig(vocab_size=vocab, rope_scaling=scaling, tie_word_embeddings=True,
                           **{**TINY_COMMON, "num_key_value_heads": 1})
    if family == "mistral":
        return MistralConfig(vocab_size=vocab, sliding_window=None, tie_word_embeddings=False,
                             **{**TINY_COMMON, "num_key_value_heads": 4})
    if family == "qwen2":
        return Qwen2Config(vocab_size=vocab, tie_word_embeddings=True, use_sliding_window=False, **TINY_COMMON)
    if family == "qwen3":  # head_dim set apart from hidden_size / heads, as Qwen3's configs do
        return Qwen3Config(vocab_size=vocab, tie_word_embeddings=True, use_sliding_window=False, head_dim=32,
                           **TINY_COMMON)
    if family == "mistral_window":  # every layer sees its last 24 positions
        return MistralConfig(vocab_size=vocab, sliding_window=24, tie_word_embeddings=False, **TINY_COMMON)
    if family == "qwen2_window":  # layer 0 sees everything, layer 1 its last 24 positions
        return Qwen2Config(vocab_size=vocab, tie_word_embeddings=True, use_sliding_window=True, sliding_window=24,
                           max_window_layers=1, **TINY_COMMON)
    if family in ("gemma", "gemma2", "gemma3", "gemma3_layers"):
        return tiny_gemma_config(family)
    return tiny_other_config(family)


def tiny_gemma_config(family: str):
    from transformers import Gemma2Config, Gemma3TextConfig, GemmaConfig

    if family == "gemma":  # head_dim set apart, as Gemma's 256 is
        return GemmaConfig(vocab_size=VOCAB, head_dim=32, hidden_act="gelu_pytorch_tanh", **TINY_COMMON)
    if family == "gemma2":  # every other layer windowed; a softmax scale of its own; caps that bite
        return Gemma2Config(vocab_size=VOCAB, head_dim=32, query_pre_attn_scalar=24, sliding_window=24,
                            attn_logit_softcapping=10.0, final_logit_softcapping=30.0,
                            hidden_activation="gelu_pytorch_tanh", **TINY_COMMON)
    # Gemma 3: windowed layers with a RoPE base of their own, the full one scaled (as 4B+);
    # gemma3_layers: three windowed layers to a full one, as its KV groups are laid out
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
    kinds = ["sliding_attention", "full_attention"]
    if family == "gemma3_layers":
        kinds = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    return Gemma3TextConfig(vocab_size=VOCAB, head_dim=32, query_pre_attn_scalar=24, sliding_window=24,
                            layer_types=kinds, rope_parameters=rope, architectures=["Gemma3ForCausalLM"],
                            **{**TINY_COMMON, "num_hidden_layers": len(kinds)})


def tiny_other_config(family: str):
    from transformers import (
        GraniteConfig,
        MinistralConfig,
        Olmo2Config,
        Olmo3Config,
        Phi3Config,
        SmolLM3Config,
    )

    if family == "granite":  # multipliers far from one, so each one shows
        return GraniteConfig(vocab_size=VOCAB, tie_word_embeddings=True, embedding_multiplier=3.0,
                             residual_multiplier=0.5, attention_multiplier=0.05, logits_scaling=4.0, **TINY_COMMON)
    if family == "olmo2":
        return Olmo2Config(vocab_size=VOCAB, tie_word_embeddings=False, **TINY_COMMON)
    if family == "olmo3":  # a window on the first layer, RoPE settings of their own on each kind
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 500000.0}}
        return Olmo3Config(vocab_size=VOCAB, tie_word_embeddings=False, sliding_window=24, rope_parameters=rope,
                           layer_types=["sliding_attention", "full_attention"], **TINY_COMMON)
    if family == "smollm3":  # the second layer without RoPE
        return SmolLM3Config(vocab_size=VOCAB, tie_word_embeddings=True, no_rope_layer_interval=2, **TINY_COMMON)
    if family == "seed_oss":  # q/k/v biases, none on o
        from transformers import SeedOssConfig

        return SeedOssConfig(vocab_size=VOCAB, tie_word_embeddings=False, head_dim=16, attention_bias=True,
                             attention_out_bias=False, **TINY_COMMON)
    if family == "ernie4_5":  # RoPE over interleaved pairs; a bias on every projection
        from transformers import Ernie4_5Config

        return Ernie4_5Config(vocab_size=VOCAB, tie_word_embeddings=True, head_dim=16, use_bias=True, **TINY_COMMON)
    if family == "ministral3":  # YaRN past 32 positions, queries scaled up past each multiple of 32
        from transformers import Ministral3Config

        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5}
        return Ministral3Config(vocab_size=VOCAB, tie_word_embeddings=False, head_dim=16, sliding_window=None,
                                rope_parameters=rope, **TINY_COMMON)
    if family == "qwen3_5":  # linear attention on layers 0 and 2 (two value heads per key head), full
        # attention with gated outputs on 1 and 3, RoPE over a quarter of each head
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(vocab_size=VOCAB, tie_word_embeddings=True, head_dim=32, linear_num_key_heads=2,
                                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
                                 linear_conv_kernel_dim=4, full_attention_interval=2,
                                 architectures=["Qwen3_5ForCausalLM"], **{**TINY_COMMON, "num_hidden_layers": 4})
    if family == "glm4":  # interleaved RoPE over half of each head, four norms a layer
        from transformers import Glm4Config

        return Glm4Config(vocab_size=VOCAB, tie_word_embeddings=False, head_dim=16, attention_bias=True,
                          **TINY_COMMON)
    if family == "ministral":  # windows named per layer
        return MinistralConfig(vocab_size=VOCAB, tie_word_embeddings=False, sliding_window=24, head_dim=16,
                               layer_types=["sliding_attention", "full_attention"], **TINY_COMMON)
    if family == "phi3":  # Phi-4-mini's shape: RoPE over 3/4 of each head, heads not a power of two wide (24)
        return Phi3Config(vocab_size=VOCAB, tie_word_embeddings=False, sliding_window=None,
                          **{**TINY_COMMON, "hidden_size": 96}, partial_rotary_factor=0.75)
    if family == "phi3_longrope":  # and Phi-3.5's LongRoPE: other factors past 64 positions
        factors = torch.linspace(1.0, 8.0, 9)  # one per rotated pair (18 columns)
        return Phi3Config(vocab_size=VOCAB, tie_word_embeddings=False, sliding_window=None,
                          **{**TINY_COMMON, "hidden_size": 96, "max_position_embeddings": 256},
                          partial_rotary_factor=0.75, original_max_position_embeddings=64,
                          rope_scaling={"type": "longrope", "short_factor": [1.0] * 9,
                                        "long_factor": factors.tolist()})
    return tiny_moe_config(family, VOCAB)


def tiny_moe_config(family: str, vocab: int):
    """Mixtures of experts, each routing its own way: Mixtral (top 2 of 4, renormalized, in
    float32), Qwen2-MoE (top 3 of 8, not renormalized, a shared expert), Qwen3-MoE (top 2 of
    6, renormalized, its second layer a dense MLP), GraniteMoE (a softmax over the top 2 of 4
    logits, Granite's multipliers), GLM-4.5 and MiniMax-M2 (DeepSeek-V3's sigmoid routing)."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if family == "mixtral":
        return MixtralConfig(vocab_size=vocab, sliding_window=None, tie_word_embeddings=False,
                             num_local_experts=4, num_experts_per_tok=2, **TINY_COMMON)
    if family == "qwen2_moe":
        return Qwen2MoeConfig(vocab_size=vocab, tie_word_embeddings=False, use_sliding_window=False,
                              num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
                              shared_expert_intermediate_size=96, norm_topk_prob=False, **TINY_COMMON)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(vocab_size=vocab, tie_word_embeddings=True, use_sliding_window=False, head_dim=32,
                              num_experts=6, num_experts_per_tok=2, moe_intermediate_size=64,
                              norm_topk_prob=True, mlp_only_layers=[1], **TINY_COMMON)
    if family == "gpt_oss":  # sinks, biases everywhere, windows on every other layer, YaRN; a clamp that bites
        from transformers import GptOssConfig

        rope = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 256, "rope_theta": 150000.0}
        return GptOssConfig(vocab_size=vocab, tie_word_embeddings=False, head_dim=16, num_local_experts=4,
                            num_experts_per_tok=2, sliding_window=24, swiglu_limit=2.0, rope_parameters=rope,
                            **{**TINY_COMMON, "intermediate_size": 64})  # MXFP4 groups of 32 fit
    if family == "granitemoe":
        from transformers import GraniteMoeConfig

        return GraniteMoeConfig(vocab_size=vocab, tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                                embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.05,
                                logits_scaling=4.0, **TINY_COMMON)
    if family in ("glm4_moe", "minimax_m2"):
        return tiny_sigmoid_routed_config(family, vocab)
    if family == "llama4":  # Llama 4's layers in small: chunks of 16 on the rotated first layer (with
        # experts: one of 4 a token, beside the shared one), the second without RoPE, its
        # queries scaled up past every 8 positions
        from transformers import Llama4TextConfig

        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256, "rope_theta": 500000.0}
        return Llama4TextConfig(vocab_size=vocab, tie_word_embeddings=False, head_dim=16, num_local_experts=4,
                                num_experts_per_tok=1, intermediate_size_mlp=96, moe_layers=[0], no_rope_layers=[1, 0],
                                attention_chunk_size=16, floor_scale=8, attn_scale=0.5, use_qk_norm=True,
                                rope_parameters=rope, **{**TINY_COMMON, "intermediate_size": 48})
    if family == "qwen3_5_moe":  # Qwen3.5's linear and gated full attention over experts: top 2 of 4,
        # renormalized, beside a gated shared expert
        from transformers import Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig(vocab_size=vocab, tie_word_embeddings=False, head_dim=32, linear_num_key_heads=2,
                                    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
                                    full_attention_interval=2, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=48, shared_expert_intermediate_size=64,
                                    architectures=["Qwen3_5MoeForCausalLM"], **TINY_COMMON)
    if family == "qwen3_next":  # the same layers, its checkpoints' linear projections grouped by key
        # head; a dense MLP on the second layer
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(vocab_size=vocab, tie_word_embeddings=False, head_dim=32, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
                               full_attention_interval=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                               moe_intermediate_size=48, shared_expert_intermediate_size=64, mlp_only_layers=[1],
                               **TINY_COMMON)
    if family.startswith("granitemoehybrid"):  # Granite 4.0: Mamba2 on layers 0 and 2 (8 heads in 2 groups),
        # NoPE attention on 1 and 3; top 2 of 4 experts beside the shared MLP, or ("_dense") the shared MLP
        # alone; "_micro", Granite-4.0-Micro's: attention with RoPE on every layer, the shared MLP alone
        from transformers import GraniteMoeHybridConfig

        micro = family.endswith("_micro")
        return GraniteMoeHybridConfig(
            vocab_size=vocab, tie_word_embeddings=True, num_local_experts=0 if family != "granitemoehybrid" else 4,
            num_experts_per_tok=2, shared_intermediate_size=96,
            layer_types=["attention"] * 4 if micro else ["mamba", "attention"] * 2,
            position_embedding_type="rope" if micro else None,
            mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_head=16, mamba_d_conv=4, mamba_expand=2,
            mamba_chunk_size=16, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.05,
            logits_scaling=4.0, architectures=["GraniteMoeHybridForCausalLM"],
            **{**TINY_COMMON, "num_hidden_layers": 4, "intermediate_size": 48})
    if family.startswith("nemotron"):
        return tiny_nemotron_config(family, vocab)
    if family in MLA_FAMILIES:
        return tiny_deepseek_config(family, vocab)
    raise ValueError(family)


def tiny_sigmoid_routed_config(family: str, vocab: int):
    """DeepSeek-V3's routing (sigmoid scores, a bias that steers the choice) over Llama's
    attention: GLM-4.5 (top 2 of 8 within the better of 2 groups, scaled, a shared expert,
    a dense first layer), MiniMax-M2 (top 2 of 8, q and k normed over whole projections,
    RoPE over half of each head: rotary_dim, as its checkpoints say it)."""
    if family == "glm4_moe":
        from transformers import Glm4MoeConfig

        return Glm4MoeConfig(vocab_size=vocab, tie_word_embeddings=False, attention_bias=True, use_qk_norm=True,
                             n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                             moe_intermediate_size=48, n_shared_experts=1, first_k_dense_replace=1,
                             routed_scaling_factor=2.5, norm_topk_prob=True, **TINY_COMMON)
    from transformers import MiniMaxM2Config

    return MiniMaxM2Config(vocab_size=vocab, tie_word_embeddings=False, head_dim=32, num_local_experts=8,
                           num_experts_per_tok=2, rotary_dim=16, rope_theta=10000.0,
                           **{**TINY_COMMON, "intermediate_size": 48})


def tiny_nemotron_config(family: str, vocab: int):
    """Nemotron-H's one-part layers: Mamba2 (time steps at least 0.5, so the floor bites), NoPE
    attention, and a ReLU^2 MLP after each; Nemotron 3's experts (without a gate, a shared one
    beside; "_latent": in a narrower space, as Super's, and chosen within the best of two
    groups) in place of two of the MLPs."""
    from transformers import NemotronHConfig

    kinds = ["linear_attention", "mlp", "full_attention", "mlp", "linear_attention", "mlp"]
    experts: dict[str, Any] = {}
    if family != "nemotron_h":
        kinds[1] = kinds[3] = "moe"
        experts = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.5, norm_topk_prob=True,
                       **(dict(moe_latent_size=24, n_group=2, topk_group=1) if family.endswith("_latent") else {}))
    return NemotronHConfig(
        vocab_size=vocab, tie_word_embeddings=False, head_dim=16, time_step_min=0.5, layers_block_type=kinds,
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16,
        architectures=["NemotronHForCausalLM"], **experts,
        **{k: v for k, v in TINY_COMMON.items() if k not in ("num_hidden_layers", "rms_norm_eps")})


def tiny_deepseek_config(family: str, vocab: int):
    """Latent attention with values narrower than the keys' nope part, and routed experts:
    V3 (queries through a low rank, interleaved RoPE under YaRN with its softmax mscale, V3's
    routing as GLM-4.5's) and V2 (queries straight from the hidden state, softmax routing
    within the best 2 of 4 groups, weights scaled, not renormalized); GLM-4.7-Flash's
    ("glm4_moe_lite") has its experts in the first layer, its dense MLP in the second."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    mla = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, moe_intermediate_size=48,
               n_routed_experts=8, first_k_dense_replace=1, **{**TINY_COMMON, "num_key_value_heads": 4})
    if family == "deepseek_v3":
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
        return DeepseekV3Config(vocab_size=vocab, tie_word_embeddings=False, q_lora_rank=24, num_experts_per_tok=2,
                                n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
                                norm_topk_prob=True, rope_parameters=rope, rope_interleave=True, **mla)
    if family == "glm4_moe_lite":  # GLM-4.7-Flash: V3's attention and routing, MLP kinds named per layer
        from transformers import Glm4MoeLiteConfig

        return Glm4MoeLiteConfig(vocab_size=vocab, tie_word_embeddings=False, q_lora_rank=24, num_experts_per_tok=2,
                                 n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=1.8,
                                 norm_topk_prob=True, mlp_layer_types=["sparse", "dense"], **mla)
    return DeepseekV2Config(vocab_size=vocab, tie_word_embeddings=False, q_lora_rank=None, num_experts_per_tok=3,
                            topk_method="group_limited_greedy", n_group=4, topk_group=2, n_shared_experts=2,
                            routed_scaling_factor=1.5, norm_topk_prob=False, **mla)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from worker.model_executor.model_loader import ensure_default_model

    return ensure_default_model(CACHE_DIR)


def copy_tokenizer(source: Path, out: Path) -> None:
    """The default model's tokenizer and chat template, beside a tiny model's weights."""
    for name in os.listdir(source):
        if name.startswith(("tokenizer", "special_tokens")) or name == "chat_template.jinja":
            shutil.copy(source / name, out / name)


def build_tiny_model(family: str, out_dir: Path, tokenizer_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(family), dtype=torch.float32)
    with torch.no_grad():  # norms start at ones (Gemma's at zeros): make each one's weights its own
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
            elif family.startswith(("gemma", "qwen3_5", "qwen3_next")) and name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)
            elif name.endswith("dt_bias"):  # linear attention's, which transformers starts at ones
                param.uniform_(-1.0, 1.0)
            elif name.endswith(("mamba.D", "mixer.D", "mamba.norm.weight")) or (
                    family.startswith("nemotron") and name.endswith("norm.weight")):
                param.uniform_(0.5, 1.5)  # Mamba2's skip, its gated norm and Nemotron-H's norms, at ones
            elif name.endswith(("mamba.conv1d.bias", "mixer.conv1d.bias")):  # at zeros
                param.uniform_(-0.5, 0.5)
            elif family in ("olmo2", "olmo3", "glm4", *MLA_FAMILIES) and name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif family == "gpt_oss" and name.endswith(("_bias", "sinks")):  # transformers starts biases at zero
                param.uniform_(-1.0, 1.0)
            elif family in ("seed_oss", "ernie4_5", "glm4", "glm4_moe") and name.endswith(".bias"):
                param.uniform_(-0.5, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a router's bias, which transformers starts at zero
                buffer.uniform_(-0.2, 0.2)
    model.save_pretrained(out_dir)
    copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


@pytest.fixture(scope="session", params=["llama", "llama3_rope", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3",
                                        "granite", "olmo2", "olmo3", "smollm3", "ministral", "seed_oss", "ernie4_5",
                                        "glm4", "ministral3", "qwen3_5"])
def tiny_model_dir(request, tmp_path_factory, default_model_dir) -> Path:
    return build_tiny_model(request.param, tmp_path_factory.mktemp(request.param), default_model_dir)


@pytest.fixture(scope="session", params=["mixtral", "qwen2_moe", "qwen3_moe", "granitemoe", "gpt_oss", "glm4_moe",
                                        "deepseek_v2", "deepseek_v3", "llama4", "qwen3_5_moe", "qwen3_next",
                                        "nemotron_3_latent", "minimax_m2"])
def tiny_moe_dir(request, tmp_path_factory, default_model_dir) -> Path:
    return build_tiny_model(request.param, tmp_path_factory.mktemp(request.param), default_model_dir)


@pytest.fixture(scope="session", params=["mistral_window", "qwen2_window"])
def tiny_window_dir(request, tmp_path_factory, default_model_dir) -> Path:
    """Sliding-window attention: on every layer, and on some layers only."""
    return build_tiny_model(request.param, tmp_path_factory.mktemp(request.param), default_model_dir)


@pytest.fixture(scope="session")
def tiny_classifier_dir(tmp_path_factory, default_model_dir) -> Path:
    """The tiny Llama's shape with a three-label classification head (a reward model or a
    classifier's layout: `model.` layers and `score.weight`)."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    config = tiny_hf_config("llama")
    config.update({"num_labels": 3, "id2label": {0: "negative", 1: "neutral", 2: "positive"},
                   "label2id": {"negative": 0, "neutral": 1, "positive": 2}, "pad_token_id": 0})
    out = tmp_path_factory.mktemp("classifier")
    AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).save_pretrained(out)
    copy_tokenizer(default_model_dir, out)
    return out


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory, default_model_dir) -> Path:
    """A mixture of experts whose second layer keeps a dense MLP."""
    return build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"), default_model_dir)


@pytest.fixture(scope="session", params=["gemma3", "mistral", "qwen2", "qwen3", "llama4", "qwen3_5"])
def tiny_image_text_dir(request, tmp_path_factory, default_model_dir) -> Path:
    """An image-text model (Gemma 3's, Mistral 3's, Qwen2.5-VL's, Qwen3-VL's, Llama 4's) around the tiny
    language model of `request.param`, with a one-layer vision tower genq does not load."""
    from transformers import (
        AutoModelForImageTextToText,
        Gemma3Config,
        Mistral3Config,
        PixtralVisionConfig,
        Qwen2_5_VLConfig,
        Qwen3VLConfig,
        SiglipVisionConfig,
    )

    torch.manual_seed(0)
    text = tiny_hf_config(request.param)
    if request.param in ("qwen2", "qwen3"):  # M-RoPE: three sections of the rotary pairs
        vision = dict(depth=1, hidden_size=32, out_hidden_size=64, num_heads=2, intermediate_size=64)
        sections = [2, 3, 3] if request.param == "qwen2" else [4, 6, 6]  # head_dim 16, 32
        text_dict = {**text.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                           "mrope_section": sections}}
        config_class = Qwen2_5_VLConfig if request.param == "qwen2" else Qwen3VLConfig
        config = config_class(text_config=text_dict, vision_config=vision, tie_word_embeddings=text.tie_word_embeddings)
    elif request.param == "qwen3_5":  # M-RoPE over the quarter of each head it rotates
        from transformers import Qwen3_5Config

        vision = dict(depth=1, hidden_size=32, out_hidden_size=64, num_heads=2, intermediate_size=64)
        text_dict = {**text.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                                                           "mrope_interleaved": True}}
        config = Qwen3_5Config(text_config=text_dict, vision_config=vision, tie_word_embeddings=text.tie_word_embeddings)
    elif request.param == "llama4":
        from transformers import Llama4Config, Llama4VisionConfig

        vision = Llama4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=32, patch_size=8, projector_input_dim=64, projector_output_dim=64,
                                    vision_output_dim=64)
        config = Llama4Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                              tie_word_embeddings=text.tie_word_embeddings)
    elif request.param == "gemma3":
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=32, patch_size=8)
        config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)
    else:
        vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     image_size=32, patch_size=8, head_dim=16)
        config = Mistral3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), spatial_merge_size=1)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # Gemma's norms start at zeros: make each one's weights its own
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and "language_model" in name:
                param.uniform_(-0.5, 0.5) if request.param == "gemma3" else param.uniform_(0.5, 1.5)
    out = tmp_path_factory.mktemp(f"{request.param}-image-text")
    model.save_pretrained(out)
    copy_tokenizer(default_model_dir, out)
    return out


MISTRAL3_PATCH, MISTRAL3_MERGE = 8, 2
MISTRAL3_IMAGE_TOKENS = {"image_token": "<issue_closed>", "image_break_token": "<issue_start>",
                         "image_end_token": "<issue_comment>"}
MISTRAL3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
    "{% else %}{% for part in m.content %}{% if part.type == 'text' %}{{ part.text }}"
    "{% else %}<issue_closed>{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_mistral3_dir(tmp_path_factory, default_model_dir) -> Path:
    """A Mistral 3 that takes images: Pixtral's vision tower and Mistral 3's projector (two
    patches merged each way) around the tiny Mistral, its image tokens three of the tokenizer's
    special tokens (the image token at Mistral's id, 10), and a chat template that writes an
    image part as that token."""
    from transformers import AutoModelForImageTextToText, Mistral3Config, PixtralVisionConfig
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    torch.manual_seed(0)
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 image_size=64, patch_size=MISTRAL3_PATCH, head_dim=16)
    config = Mistral3Config(text_config=tiny_hf_config("mistral").to_dict(), vision_config=vision.to_dict(),
                            spatial_merge_size=MISTRAL3_MERGE, image_token_index=10)
    out = tmp_path_factory.mktemp("mistral3")
    AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(out)
    copy_tokenizer(default_model_dir, out)
    PixtralImageProcessorPil(size={"longest_edge": 64}, patch_size=MISTRAL3_PATCH).save_pretrained(out)
    processor = {**MISTRAL3_IMAGE_TOKENS, "patch_size": MISTRAL3_PATCH, "spatial_merge_size": MISTRAL3_MERGE}
    (out / "processor_config.json").write_text(json.dumps(processor))
    (out / "chat_template.jinja").write_text(MISTRAL3_TEMPLATE)
    return out


# Gemma 3's <start_of_image>, image soft token and <end_of_image>, as three of the tokenizer's special tokens
GEMMA3_IMAGE_TOKENS = {"boi_token_index": 8, "image_token_index": 10, "eoi_token_index": 9}
GEMMA3_TEMPLATE = MISTRAL3_TEMPLATE.replace("{% else %}<issue_closed>{% endif %}", "{% else %}<issue_start>{% endif %}")


@pytest.fixture(scope="session")
def tiny_gemma3_images_dir(tmp_path_factory, default_model_dir) -> Path:
    """A Gemma 3 that takes images: a one-layer SigLIP tower on 32 x 32 pixels (patches of 4)
    and Gemma 3's projector pooling them to 16 image tokens, around the tiny Gemma 3 (a window
    of 24 on one of its two layers); its image tokens three of the tokenizer's special tokens,
    and a chat template that writes an image part as the start-of-image token."""
    from transformers import AutoModelForImageTextToText, Gemma3Config, SiglipVisionConfig
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    torch.manual_seed(0)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=4)
    config = Gemma3Config(text_config=tiny_hf_config("gemma3").to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=16, **GEMMA3_IMAGE_TOKENS)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # Gemma's norms start at zeros, and the projection too: make them the model's own
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and "vision_tower" not in name:
                param.uniform_(-0.5, 0.5)
            elif name.endswith("mm_input_projection_weight"):
                param.normal_(0.0, 0.5)
    out = tmp_path_factory.mktemp("gemma3-images")
    model.save_pretrained(out)
    copy_tokenizer(default_model_dir, out)
    Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(out)
    (out / "chat_template.jinja").write_text(GEMMA3_TEMPLATE)
    return out


QWEN_VL_PATCH, QWEN_VL_MERGE = 8, 2
# Qwen2.5-VL's <|vision_start|>, <|image_pad|> and <|vision_end|>, as three of the tokenizer's special tokens
QWEN_VL_IMAGE = "<issue_start><issue_closed><issue_comment>"
QWEN_VL_TEMPLATE = MISTRAL3_TEMPLATE.replace("{% else %}<issue_closed>{% endif %}",
                                             "{% else %}" + QWEN_VL_IMAGE + "{% endif %}")


def build_tiny_qwen_vl(version: str, out: Path, tokenizer_dir: Path) -> Path:
    """A Qwen2.5-VL ("qwen2_5_vl"), Qwen2-VL ("qwen2_vl") or Qwen3-VL ("qwen3_vl", "qwen3_vl_moe"
    around the tiny Qwen3-MoE) that takes images: a two-block
    vision transformer (Qwen2.5-VL's: one block windowed, windows of 2 x 2 merged patches,
    one whole) and its patch merger around the tiny Qwen2 with M-RoPE sections, its image
    token at id 10, and a chat template that writes an image part as vision start, image
    pad, vision end."""
    from transformers import (
        AutoModelForImageTextToText,
        Qwen2_5_VLConfig,
        Qwen2VLConfig,
        Qwen3_5Config,
        Qwen3VLConfig,
        Qwen3VLMoeConfig,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    torch.manual_seed(0)
    qwen3 = version.startswith("qwen3")
    text = tiny_hf_config({"qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe", "qwen3_5": "qwen3_5"}.get(version, "qwen2"))
    sections = [4, 6, 6] if qwen3 else [2, 3, 3]  # head_dim 32, 16
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections}
    if version == "qwen3_5":  # a quarter of each 32-wide head rotates: 4 pairs, interleaved
        rope.update(mrope_section=[2, 1, 1], partial_rotary_factor=0.25, mrope_interleaved=True)
    text_dict = {**text.to_dict(), "rope_parameters": rope}
    if version == "qwen3_vl_moe":  # experts 48 wide: none of their matrices square, so layouts tell apart
        text_dict["moe_intermediate_size"] = 48
        del text_dict["norm_topk_prob"]  # not in Qwen3-VL-MoE's configs: its router always renormalizes
    vision: dict = dict(depth=2, num_heads=2, patch_size=QWEN_VL_PATCH, spatial_merge_size=QWEN_VL_MERGE)
    if version == "qwen2_5_vl":
        vision.update(hidden_size=32, out_hidden_size=text.hidden_size, intermediate_size=64,
                      window_size=2 * QWEN_VL_PATCH * QWEN_VL_MERGE, fullatt_block_indexes=[1])
    elif version == "qwen3_5":  # Qwen3-VL's vision transformer without deepstack
        vision.update(hidden_size=32, out_hidden_size=text.hidden_size, intermediate_size=64,
                      num_position_embeddings=16)
    elif qwen3:  # deepstack embeddings from both blocks, added after both text layers
        vision.update(hidden_size=32, out_hidden_size=text.hidden_size, intermediate_size=64,
                      num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
    else:  # Qwen2-VL names the vision width embed_dim and the merger's output hidden_size
        vision.update(embed_dim=32, hidden_size=text.hidden_size, mlp_ratio=2)
    config_class = {"qwen2_vl": Qwen2VLConfig, "qwen2_5_vl": Qwen2_5_VLConfig, "qwen3_vl": Qwen3VLConfig,
                    "qwen3_vl_moe": Qwen3VLMoeConfig, "qwen3_5": Qwen3_5Config}[version]
    config = config_class(text_config=text_dict, vision_config=vision, tie_word_embeddings=text.tie_word_embeddings,
                          image_token_id=10, vision_start_token_id=8, vision_end_token_id=9)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # deepstack embeddings as large as the others, so that leaving them out shows
        for name, param in model.named_parameters():
            if "deepstack_merger_list" in name and name.endswith("linear_fc2.weight"):
                param.normal_(0.0, 1.0)
    # as kept in memory: reverting Qwen3-VL-MoE's experts to the Hub's layout fails in transformers' save
    model.save_pretrained(out, save_original_format=False)
    copy_tokenizer(tokenizer_dir, out)
    factor = QWEN_VL_PATCH * QWEN_VL_MERGE
    Qwen2VLImageProcessorPil(patch_size=QWEN_VL_PATCH, merge_size=QWEN_VL_MERGE, min_pixels=factor * factor,
                             max_pixels=64 * 64).save_pretrained(out)
    (out / "chat_template.jinja").write_text(QWEN_VL_TEMPLATE)
    return out


AUDIO_MELS, AUDIO_WINDOW_S = 16, 1  # the tiny Qwen2-Audio's mel bins, and its encoder's window (100 frames)


@pytest.fixture(scope="session")
def tiny_qwen2_audio_dir(tmp_path_factory, default_model_dir) -> Path:
    """A Qwen2-Audio: a two-layer Whisper-style audio tower over 16 mel bins and a 1 s window
    (50 positions, pooled to 25) and its projector around the tiny Qwen2, its audio token at
    id 10 (audio bos and eos at 8 and 9), and a chat template that writes an audio part as
    the three."""
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        WhisperFeatureExtractor,
    )

    torch.manual_seed(0)
    text = tiny_hf_config("qwen2")
    text.tie_word_embeddings = False  # as Qwen2-Audio-7B's (transformers' class never ties its head)
    audio = dict(d_model=32, encoder_attention_heads=2, encoder_ffn_dim=64, encoder_layers=2, num_mel_bins=AUDIO_MELS,
                 max_source_positions=50 * AUDIO_WINDOW_S)
    config = Qwen2AudioConfig(audio_config=audio, text_config=text.to_dict(), audio_token_index=10,
                              tie_word_embeddings=text.tie_word_embeddings)
    out = tmp_path_factory.mktemp("qwen2-audio")
    Qwen2AudioForConditionalGeneration(config).to(torch.float32).save_pretrained(out)
    copy_tokenizer(default_model_dir, out)
    WhisperFeatureExtractor(feature_size=AUDIO_MELS, chunk_length=AUDIO_WINDOW_S).save_pretrained(out)
    (out / "chat_template.jinja").write_text(QWEN_VL_TEMPLATE)
    return out


# Whisper's special tokens, then its timestamps (0.02 s apart, over the tiny model's 1 s window)
WHISPER_TOKENS = ("<|startoftranscript|>", "<|en|>", "<|fr|>", "<|de|>", "<|translate|>", "<|transcribe|>",
                  "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>", *(f"<|{k * 0.02:.2f}|>" for k in range(51)))


@pytest.fixture(scope="session")
def tiny_whisper_dir(tmp_path_factory, default_model_dir) -> Path:
    """A Whisper: two encoder and two decoder layers of width 32 over 16 mel bins and a 1 s
    window (50 encoder positions), 64 decoder positions, with the default model's tokenizer
    and Whisper's special tokens added after it (WHISPER_TOKENS, from id 49152)."""
    from transformers import (
        AutoTokenizer,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
    )

    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=49152 + len(WHISPER_TOKENS), num_mel_bins=AUDIO_MELS, d_model=32, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=2, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=48,
                           max_source_positions=50 * AUDIO_WINDOW_S, max_target_positions=64,
                           decoder_start_token_id=1, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                           init_std=0.3)  # (at 0.02 the audio barely moves the logits: every clip reads alike)
    out = tmp_path_factory.mktemp("whisper")
    WhisperForConditionalGeneration(config).to(torch.float32).save_pretrained(out)
    copy_tokenizer(default_model_dir, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_special_tokens({"additional_special_tokens": list(WHISPER_TOKENS)})
    tokenizer.chat_template = None  # (Whisper's has none)
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    WhisperFeatureExtractor(feature_size=AUDIO_MELS, chunk_length=AUDIO_WINDOW_S).save_pretrained(out)
    generation = json.loads((out / "generation_config.json").read_text())
    generation.update(no_timestamps_token_id=tokenizer.convert_tokens_to_ids("<|notimestamps|>"),
                      begin_suppress_tokens=[2, 220], max_initial_timestamp_index=10,
                      alignment_heads=[[0, 1], [1, 0], [1, 3]])
    (out / "generation_config.json").write_text(json.dumps(generation))
    return out


def built_once(build: Callable[[str, Path, Path], Path], tmp_path_factory, tokenizer_dir: Path
               ) -> Callable[[str], Path]:
    """`build(name, out_dir, tokenizer_dir)` as a function of the name alone, each name built
    on its first call and kept."""
    built: dict[str, Path] = {}

    def model(name: str) -> Path:
        if name not in built:
            built[name] = build(name, tmp_path_factory.mktemp(name), tokenizer_dir)
        return built[name]

    return model


@pytest.fixture(scope="session")
def tiny_qwen_vl(tmp_path_factory, default_model_dir):
    """build_tiny_qwen_vl's model of a version, built once a session on first use."""
    return built_once(build_tiny_qwen_vl, tmp_path_factory, default_model_dir)


@pytest.fixture(scope="session")
def tiny_qwen_vl_dir(tiny_qwen_vl) -> Path:
    return tiny_qwen_vl("qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_longrope_dir(tmp_path_factory, default_model_dir) -> Path:
    return build_tiny_model("phi3_longrope", tmp_path_factory.mktemp("phi3_longrope"), default_model_dir)


@pytest.fixture(scope="session")
def tiny_gemma3_layers_dir(tmp_path_factory, default_model_dir) -> Path:
    """Gemma 3 with three windowed layers to a full one."""
    return build_tiny_model("gemma3_layers", tmp_path_factory.mktemp("gemma3_layers"), default_model_dir)


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory, default_model_dir):
    """The tiny model of a family named at the call, built once a session."""
    return built_once(build_tiny_model, tmp_path_factory, default_model_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, default_model_dir) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), default_model_dir)


@pytest.fixture(scope="session")
def tuned_llama_dir(tiny_llama_dir: Path, tmp_path_factory) -> Path:
    """The tiny Llama with sampling values in its generation_config.json, which requests that
    leave them unset take: temperature 0.9, top_k 1 (so sampling is greedy), repetition
    penalty 1.5, max_new_tokens 20."""
    out = tmp_path_factory.mktemp("tuned") / "model"
    shutil.copytree(tiny_llama_dir, out)
    path = out / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**config, "temperature": 0.9, "top_k": 1, "repetition_penalty": 1.5,
                                "max_new_tokens": 20}))
    return out


def build_retrained(model_dir: Path, out: Path, seed: int = 1) -> Path:
    """`model_dir`'s checkpoint after some training, as far as serving can tell: the same files,
    shapes and tokenizer, every floating-point tensor moved by noise of its own scale (a weights
    update's checkpoint; an image-text model's vision tower too)."""
    shutil.copytree(model_dir, out)
    generator = torch.Generator().manual_seed(seed)
    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(path)
        for name, tensor in tensors.items():
            if tensor.is_floating_point():
                scale = tensor.float().std(correction=0).clamp_min(0.05).item() if tensor.numel() else 0.0
                tensors[name] = tensor + (torch.randn(tensor.shape, generator=generator) * scale).to(tensor.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def retrain() -> Callable[[Path, Path], Path]:
    """build_retrained, for a model of the test's own."""
    return build_retrained


@pytest.fixture(scope="session")
def retrained_llama_dir(tiny_llama_dir: Path, tmp_path_factory) -> Path:
    return build_retrained(tiny_llama_dir, tmp_path_factory.mktemp("retrained") / "model")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory, default_model_dir) -> Path:
    """A second model, whose k/v projections are wider than the tiny Llama's."""
    return build_tiny_model("mistral", tmp_path_factory.mktemp("mistral"), default_model_dir)


ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_lora_adapter(model_dir: Path, out_dir: Path, seed: int, **lora_config) -> Path:
    """A PEFT LoRA adapter for `model_dir` with random (not zero) B matrices, as PEFT saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_config)).save_pretrained(out_dir)
    return out_dir


def tiny_model_and_adapter(family: str, seed: int, targets: list[str], tmp_path_factory,
                           tokenizer_dir: Path) -> tuple[Path, Path]:
    """A tiny model of `family` and a rank-8 adapter over its modules `targets`."""
    model = build_tiny_model(family, tmp_path_factory.mktemp(family), tokenizer_dir)
    adapter = build_lora_adapter(model, tmp_path_factory.mktemp(f"{family}-adapter"), seed, r=8, lora_alpha=16,
                                 target_modules=targets)
    return model, adapter


@pytest.fixture(scope="session")
def tiny_adapter(tmp_path_factory, default_model_dir):
    """tiny_model_and_adapter for a family, seed and targets named at the call."""
    return lambda family, seed, targets: tiny_model_and_adapter(family, seed, targets, tmp_path_factory,
                                                                default_model_dir)


@pytest.fixture(scope="session")
def tiny_ernie_adapter(tmp_path_factory, default_model_dir) -> tuple[Path, Path]:
    """A tiny Ernie 4.5 (RoPE over interleaved pairs) and an adapter on its attention."""
    return tiny_model_and_adapter("ernie4_5", 5, ["q_proj", "k_proj", "v_proj", "o_proj"], tmp_path_factory,
                                  default_model_dir)


@pytest.fixture(scope="session")
def tiny_phi3_adapter(tmp_path_factory, default_model_dir) -> tuple[Path, Path]:
    """A tiny Phi-3 and an adapter on its own fused projections (qkv_proj, gate_up_proj)."""
    return tiny_model_and_adapter("phi3", 4, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], tmp_path_factory,
                                  default_model_dir)


@pytest.fixture(scope="session")
def tiny_llama_adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    """Two adapters of the tiny llama: `all` on every projection (rank 8), `qv` on q and v
    only (rank 4, rsLoRA scaling, a per-module alpha)."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all": build_lora_adapter(tiny_llama_dir, root / "all", 1, r=8, lora_alpha=16, target_modules=ALL_TARGETS),
        "qv": build_lora_adapter(tiny_llama_dir, root / "qv", 2, r=4, lora_alpha=8, use_rslora=True,
                                 target_modules=["q_proj", "v_proj"], alpha_pattern={"v_proj": 2}),
    }
