"""The GPU check (run on a CUDA machine; each part prints as it ends, so a run cut short still
reports the parts it finished):

1. every Triton kernel against its torch reference at real sizes (the fused MoE at a
   Qwen3-30B-A3B layer's), timed with `triton.testing.do_bench` (median), bandwidth beside a
   device-to-device copy of the same bytes;
2. greedy outputs of the engine on CUDA against the CPU path (float32: equal; bfloat16: close),
   and with CUDA graphs against without (`enforce_eager`); the same with LoRA adapters mixed in
   one batch (random rank-16 adapters, written by `benchmarks/lora.py`); n-gram speculative
   decoding against plain decoding (float32: equal); fp8 weights (`quantization="fp8"`: the
   fp8 kernel against the CPU's dequantized weights, float32: equal); an fp8 KV cache
   (`kv_cache_dtype="fp8"`, float32: equal); embeddings (float32: equal up to summation
   order); the model's shape remade as a Qwen3 (its per-head q/k norms), a Qwen3-MoE and a
   Mixtral (routed experts: the fused MoE kernel in the decode CUDA graphs), a Gemma 2
   (capped scores, a window on every other layer) and a Gemma 3 (a RoPE table per layer
   kind), a Phi-3.5 (96-wide heads, partial rotary, LongRoPE), a gpt-oss (attention sinks,
   biased experts; and with MXFP4 experts), a GLM-4.5 (DeepSeek-V3's routing), a DeepSeek-V3
   (latent attention, one 576-wide cache head), a Llama 4 (chunked attention, NoPE layers,
   experts weighing their input), a Qwen3.5, a Granite 4.0-H and a Nemotron-H (linear
   attention's and Mamba2's states through the scan kernel, their decodes in the CUDA
   graphs; and one such layer timed on the torch path against the kernel path), a W4A16 Llama (packed int4 weights), an AWQ Llama (int4 less
   zero points) and a Qwen3-MoE with fp8 experts,
   greedy, CUDA against CPU; and a Gemma 3 (image tokens attending both ways), a Mistral 3 (a
   Pixtral tower), a Qwen2.5-VL (M-RoPE) and a Qwen3-VL (deepstack) around it on a prompt
   with two images, CUDA against CPU; a small Whisper (encoder-decoder: cross-attention over
   per-request slots, its timestamp rules) on two clips, CUDA against CPU; where the host has two GPUs, a Qwen3 split over them
   (`tensor_parallel_size=2`) against one, float32: equal; KV offloading (a prompt's blocks
   pushed out of a small pool and copied back from pinned host memory), its greedy tokens
   before and after, float32: equal; a DeepSeek-V3's MTP layer as the draft (`method mtp`),
   and a Qwen3 with an EAGLE-3 head (`method eagle3`): each step's guesses and the outputs on
   CUDA against CPU, float32: equal, and with both final norms zeroed every guess kept;
3. W1 through the engine (bfloat16; with and without CUDA graphs; with fp8 weights; with async_scheduling) and through transformers'
   `generate` on the same GPU, the throughputs and the ratios.

    python benchmarks/gpu_check.py [--model DIR] [--load-format dummy] [--num-prompts 128] [--skip-kernels]
        [--budget-s 270] [--only kernels,greedy,W1,...]

The parts run in the order `sections` gives: the kernels, greedy CUDA against CPU and W1
first (about 3.5 minutes on an H200 with Triton's cache cold), then the others. No part starts
past `--budget-s` seconds (those left are listed as not run), so the check ends inside five
minutes; `--only` runs the named parts, for the rest in a second call. Each part reports its
own failure and the rest still run. Prints a short table last.

On the lent device machine nothing can be downloaded, and the default model's GGUF (98 MB)
is over what travels (64 MiB): there the check runs SmolLM2-135M's shape with seeded random
weights (`--load-format dummy`; speed does not depend on the values, and both paths of each
comparison get the same weights). Its python3 (3.12, on 2026-12-04 with torch 2.11, Triton 3.6,
transformers 5.17) has msgpack, pillow and numpy but not redis, which `producer` imports.
Prepare here, in the repository root (`resolve_model_path(None)` writes the model's directory):

    echo /.whl/ >> .git/info/exclude; echo /.gpu_model/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux2014_x86_64 -d .whl redis==5.3.1 PyJWT==2.10.1
    mkdir -p .gpu_model && cp ~/.cache/genq/models/SmolLM2-135M-Instruct/{config.json,\
tokenizer.json,tokenizer_config.json,chat_template.jinja} .gpu_model/

and run there (carry `.whl` and `.gpu_model`):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
    PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py \
        --model .gpu_model --load-format dummy

A second call on a fresh machine compiles the kernels again: with TRITON_CACHE_DIR=/tmp/tcache,
end the first with `tar czf $OUT/t.tgz -C /tmp/tcache .` (7 MB), carry it back in an ignored
folder and unpack it before the next.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable

import torch

# the correctness checks' engines: a few requests each, so few decode graphs to capture and a
# small KV pool (one engine's pool never crowds out the next's, whenever the first is freed)
SMALL = {"max_num_seqs": 8, "num_gpu_blocks_override": 1024}


def check_engine_vs_cpu(model: str | None, load_format: str, num_tokens: int = 32) -> list[str]:
    from worker import LLM, SamplingParams

    prompts = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "1, 2, 3,"]
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)

    def greedy(**kwargs) -> list[list[int]]:
        llm = LLM(model, max_model_len=2048, load_format=load_format, **SMALL, **kwargs)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    lines = []
    cpu_runs = {}
    for dtype in ("float32", "bfloat16"):
        cpu = cpu_runs[dtype] = greedy(dtype=dtype, device="cpu")
        gpu = greedy(dtype=dtype, device="cuda")
        lines.append(f"greedy cuda vs cpu {dtype:<9} {_compare(cpu, gpu)}")
        if dtype == "float32":
            ngram = {"method": "ngram", "num_speculative_tokens": 4}
            spec = greedy(dtype=dtype, device="cuda", speculative_config=ngram)
            lines.append(f"greedy cuda ngram vs plain float32 {_compare(gpu, spec)}")
    # the baseline for "close": how far bfloat16 alone moves the tokens, on the CPU
    lines.append(f"greedy cpu bfloat16 vs float32 {_compare(cpu_runs['float32'], cpu_runs['bfloat16'])}")
    eager = greedy(dtype="bfloat16", device="cuda", enforce_eager=True)
    lines.append(f"greedy cuda graphs vs eager bfloat16 {_compare(eager, gpu)}")
    # fp8 weights: the fp8 kernel (in the decode graphs) against the CPU's dequantized weights
    fp8 = [greedy(dtype="float32", device=device, quantization="fp8") for device in ("cpu", "cuda")]
    lines.append(f"greedy cuda vs cpu fp8 weights float32 {_compare(*fp8)}")
    # an fp8 KV cache: the cache kernel's rounding against torch's
    fp8_kv = [greedy(dtype="float32", device=device, kv_cache_dtype="fp8") for device in ("cpu", "cuda")]
    lines.append(f"greedy cuda vs cpu fp8 KV cache float32 {_compare(*fp8_kv)}")
    return lines


def check_lora_vs_cpu(model: str | None, load_format: str, num_tokens: int = 32,
                      devices: tuple[str, str] = ("cpu", "cuda")) -> list[str]:
    """Two adapters and the base model in one batch, on CUDA (graphs for base-only steps)
    against the CPU path, float32."""
    import tempfile
    from pathlib import Path

    from lora import write_adapter  # benchmarks/lora.py, beside this script

    from worker import LLM, LoRARequest, SamplingParams
    from worker.model_executor.model_loader import resolve_model_path

    prompts = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "1, 2, 3,"]
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        a, b = (LoRARequest(f"a{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", resolve_model_path(model), 16, i)))
                for i in range(2))
        loras = [a, None, b, a]
        runs = {}
        for device in devices:
            llm = LLM(model, dtype="float32", device=device, max_model_len=2048, load_format=load_format,
                      enable_lora=True, max_loras=2, **SMALL)
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            runs[device] = [o.outputs[0].token_ids for o in outs]
    first, second = devices
    return [f"greedy lora {second} vs {first} float32 {_compare(runs[first], runs[second])}"]


def check_embed_vs_cpu(model: str | None, load_format: str, devices: tuple[str, str] = ("cpu", "cuda")) -> list[str]:
    """LLM.embed's vectors on CUDA against the CPU path (float32: equal up to summation order)."""
    from worker import LLM

    prompts = ["Hello, my name is", "The capital of France is " * 8, "def fibonacci(n):"]
    vectors = []
    for device in devices:
        llm = LLM(model, dtype="float32", device=device, max_model_len=2048, load_format=load_format, **SMALL)
        vectors.append(torch.tensor([o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]))
    return [f"embed {devices[1]} vs {devices[0]} float32 max abs diff {(vectors[0] - vectors[1]).abs().max().item():.2e}"]


# the model's shape remade as other architectures: what each one adds to the CUDA path
REMADE = {
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},  # per-head q/k norms
    # routed experts (the fused MoE kernel, inside the decode CUDA graphs): top 2 of 8,
    # renormalized, the second layer dense; and Mixtral's float32 routing weights
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 256, "norm_topk_prob": True,
                  "mlp_only_layers": [1]},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 8,
                "num_experts_per_tok": 2, "sliding_window": None},
    # the kernel's score cap and a window short enough to bite, on every other layer
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "sliding_window": 8,
               "query_pre_attn_scalar": 64, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "hidden_activation": "gelu_pytorch_tanh", "layer_types": None},
    # a RoPE table per layer kind, in the decode CUDA graphs
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "sliding_window": 8,
               "query_pre_attn_scalar": 64, "hidden_activation": "gelu_pytorch_tanh", "layer_types": None,
               "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}},
    # Phi-3.5 / Phi-4-mini: 96-wide heads (kernel tiles padded to 128), 3/4 of each rotated
    # (72 columns), LongRoPE's long factors (max_model_len 2048 is past the original 256)
    "phi3_longrope": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "num_attention_heads": 6,
                      "num_key_value_heads": 3, "head_dim": 96, "partial_rotary_factor": 0.75,
                      "sliding_window": None, "original_max_position_embeddings": 256,
                      "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 36,
                                          "long_factor": [1.0 + i / 5 for i in range(36)]}},
    # gpt-oss: attention sinks (in the decode CUDA graphs' split-KV attention), biased experts
    # with the clamped SwiGLU, a window on every other layer
    "gpt_oss": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
                "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 8, "layer_types": None},
    # and its experts in MXFP4, as OpenAI's checkpoints hold them (e2m1 codes on the fused MoE kernel)
    "gpt_oss_mxfp4": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
                      "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 8, "layer_types": None,
                      "quantization_config": {"quant_method": "mxfp4"}},
    # GLM-4.5: DeepSeek-V3's grouped sigmoid routing (float32 router, scaled weights over one,
    # an ungated shared expert) in the decode CUDA graphs, RoPE over half of each head
    "glm4_moe": {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "n_routed_experts": 8,
                 "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "moe_intermediate_size": 256,
                 "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
                 "norm_topk_prob": True, "partial_rotary_factor": 0.5, "attention_bias": True},
    # DeepSeek-V3's latent attention at its real head sizes: the cache's one head of 512 + 64
    # columns (kernel tiles padded to 1024), 9 query heads on it, values the key's first 512;
    # interleaved RoPE under YaRN with its softmax mscale
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "q_lora_rank": 384,
                    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "head_dim": 64, "num_key_value_heads": 9, "n_routed_experts": 8, "num_experts_per_tok": 2,
                    "n_group": 2, "topk_group": 1, "moe_intermediate_size": 256, "n_shared_experts": 1,
                    "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                    "rope_interleave": True,
                    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0,
                                        "mscale": 1.0, "mscale_all_dim": 1.0}},
    # quantized checkpoints' layouts: W4A16 (int4 in groups of 128, packed: hidden 576 ends
    # mid-group), and fp8 experts with 128 x 128 blocks (inside the decode CUDA graphs)
    "llama_w4a16": {"quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}}},
    # AWQ's layout: int4 with a zero point per group of 128 (dummy weights: zero points zero)
    "llama_awq": {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                          "version": "gemm"}},
    # Llama 4: chunks of 8 on three layers of four (the kernel's CHUNK bound, their KV kept as
    # windows), unit q/k norms, NoPE layers with queries scaled past every 8 positions; one
    # expert of 8 a token weighing its input, a shared expert, on every other layer
    "llama4": {"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "num_local_experts": 8,
               "num_experts_per_tok": 1, "intermediate_size": 256, "intermediate_size_mlp": 1536,
               "interleave_moe_layer_step": 2, "attention_chunk_size": 8, "floor_scale": 8, "attn_scale": 0.5,
               "use_qk_norm": True},
    # Qwen3.5: Gated DeltaNet on three layers of four (torch ops on the device, a state slot per
    # request, no decode graphs), gated full attention on the fourth, RoPE over a quarter of each head
    "qwen3_5": {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "linear_num_key_heads": 3,
                "linear_num_value_heads": 6, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                "linear_conv_kernel_dim": 4, "layer_types": None},
    # Granite 4.0-H's dense shape: Mamba2 (18 heads of 64, one group, state 64) on five layers of
    # six, NoPE attention on the sixth, the shared MLP alone
    "granitemoehybrid": {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
                         "layer_types": (["mamba"] * 5 + ["attention"]) * 5, "num_local_experts": 0,
                         "shared_intermediate_size": 1536, "mamba_n_heads": 18, "mamba_d_head": 64,
                         "mamba_n_groups": 1, "mamba_d_state": 64, "mamba_d_conv": 4, "mamba_expand": 2},
    # Nemotron-H's: a layer each of Mamba2 (18 heads of 64), NoPE attention or a ReLU^2 MLP
    "nemotron_h": {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
                   "layers_block_type": ["linear_attention", "mlp", "linear_attention", "mlp", "full_attention",
                                         "mlp"] * 5, "mamba_num_heads": 18, "mamba_head_dim": 64, "n_groups": 1,
                   "ssm_state_size": 64, "conv_kernel": 4},
    # Nemotron 3 Super's: experts without a gate (ReLU^2 on the fused MoE kernel, in the decode
    # CUDA graphs) in a latent space of 256, routed within the best of two groups, a shared expert
    "nemotron_3": {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
                   "layers_block_type": ["linear_attention", "moe", "linear_attention", "moe", "full_attention",
                                         "moe"] * 5, "mamba_num_heads": 18, "mamba_head_dim": 64, "n_groups": 1,
                   "ssm_state_size": 64, "conv_kernel": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 256, "moe_shared_expert_intermediate_size": 512, "n_group": 2,
                   "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "moe_latent_size": 256},
    "qwen3_moe_fp8": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8,
                      "num_experts_per_tok": 2, "moe_intermediate_size": 256, "norm_topk_prob": True,
                      "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}},
}


def remake(model: str | None, arch: str | None, out_dir, **overrides) -> str:
    """Write the model's config and tokenizer to `out_dir`, the config remade as `arch`
    (REMADE; None: its own architecture), then `overrides`; load it with load_format="dummy"."""
    import json
    import shutil
    from pathlib import Path

    from worker.model_executor.model_loader import resolve_model_path

    source, out = resolve_model_path(model), Path(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    config = json.loads((source / "config.json").read_text())
    config.update({"attention_bias": False, "head_dim": config["hidden_size"] // config["num_attention_heads"],
                   "use_sliding_window": False, **REMADE.get(arch or "", {}), **overrides})
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def check_remade_vs_cpu(model: str | None, arch: str, devices: tuple[str, str] = ("cpu", "cuda"),
                        num_tokens: int = 16) -> list[str]:
    """The model's shape remade as `arch` (seeded random weights), greedy on CUDA against the
    CPU path in float32."""
    import tempfile

    from worker import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        remade = remake(model, arch, tmp)
        runs = []
        for device in devices:
            llm = LLM(remade, dtype="float32", device=device, max_model_len=2048, load_format="dummy", **SMALL)
            runs.append([o.outputs[0].token_ids for o in llm.generate(["Hello, my name is", "1, 2, 3,"], params,
                                                                      use_tqdm=False)])
    return [f"greedy {arch} {devices[1]} vs {devices[0]} float32 {_compare(runs[0], runs[1])}"]


def check_tensor_parallel(model: str | None, device: str = "cuda", num_tokens: int = 16) -> list[str]:
    """The model's shape remade as a Qwen3 with 8 query heads and 2 KV heads (random weights, saved as a
    checkpoint: each rank reads its share), greedy split over two GPUs against one, float32."""
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM

    from worker import LLM, SamplingParams

    if device == "cuda" and torch.cuda.device_count() < 2:
        return [f"tensor parallel: not run ({torch.cuda.device_count()} GPU; it needs 2)"]
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        remade = remake(model, "qwen3", tmp, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(remade), dtype=torch.float32).save_pretrained(tmp)
        runs = []
        for size in (1, 2):
            llm = LLM(remade, dtype="float32", device=device, max_model_len=2048, tensor_parallel_size=size,
                      **SMALL)
            runs.append([o.outputs[0].token_ids for o in llm.generate(["Hello, my name is", "1, 2, 3,"], params,
                                                                      use_tqdm=False)])
            del llm
    return [f"greedy qwen3 split over 2 {device}s vs 1, float32 {_compare(runs[0], runs[1])}"]


def check_images_vs_cpu(model: str | None, devices: tuple[str, str] = ("cpu", "cuda"), num_tokens: int = 16) -> list[str]:
    """The model's shape remade as image-text models around it (seeded random weights),
    greedy on a prompt with two images, on CUDA against the CPU path in float32: Gemma 3 (its
    image tokens attend both ways: the kernel's attend_until, a window of 8), Mistral 3 (a
    two-layer Pixtral tower, patches of 14 merged two by two), Qwen2.5-VL (a two-block
    windowed vision transformer; M-RoPE, whose prompt rows the rotary kernel reads from a
    table of the step's own) and Qwen3-VL (M-RoPE interleaved, deepstack embeddings). The
    image embeddings enter the eager prefill; decode runs in the CUDA graphs (for Qwen, at
    positions shifted by the images). Also where a running request's embeddings rest on
    CUDA (cpu: the device holds only the lately encoded ones, in memory set aside)."""
    import json
    import tempfile
    from pathlib import Path

    import numpy as np
    from PIL import Image
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from worker import LLM, SamplingParams

    tokens = {"image_token": "<issue_closed>", "image_break_token": "<issue_start>", "image_end_token": "<issue_comment>"}
    images = [Image.fromarray(np.random.RandomState(seed).randint(0, 255, (h, w, 3), dtype=np.uint8))
              for seed, (h, w) in enumerate([(200, 150), (90, 224)])]
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    lines = []
    for arch in ("gemma3", "mistral3", "qwen2_5_vl", "qwen3_vl"):
        with tempfile.TemporaryDirectory() as tmp:
            # for its tokenizer files and text config; the config is replaced below
            out = Path(remake(model, "gemma3" if arch == "gemma3" else "qwen3", tmp))
            text = json.loads((out / "config.json").read_text())
            if arch == "gemma3":  # image tokens that see their whole image; a window of 8 before them
                image = "<issue_start>"
                vision = {"model_type": "siglip_vision_model", "hidden_size": 256, "intermediate_size": 512,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 224, "patch_size": 14}
                config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                          "text_config": text, "vision_config": vision, "mm_tokens_per_image": 64,
                          "boi_token_index": 8, "eoi_token_index": 9, "image_token_index": 10}
                Gemma3ImageProcessorPil(size={"height": 224, "width": 224}).save_pretrained(out)
            elif arch == "mistral3":
                image = "<issue_closed>"
                text.update(architectures=["LlamaForCausalLM"], model_type="llama")
                vision = {"model_type": "pixtral", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "head_dim": 64, "image_size": 224, "patch_size": 14}
                config = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
                          "text_config": text, "vision_config": vision, "spatial_merge_size": 2, "image_token_index": 10,
                          "projector_hidden_act": "gelu", "multimodal_projector_bias": False, "vision_feature_layer": -1}
                PixtralImageProcessorPil(size={"longest_edge": 224}, patch_size=14).save_pretrained(out)
                (out / "processor_config.json").write_text(json.dumps({**tokens, "patch_size": 14,
                                                                       "spatial_merge_size": 2}))
            else:  # Qwen2.5-VL: M-RoPE in sections; Qwen3-VL: interleaved, and deepstack embeddings
                image = "<issue_start><issue_closed><issue_comment>"
                half = (text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]) // 2
                side = half * 3 // 8 if arch == "qwen2_5_vl" else half * 5 // 16  # Qwen's [16, 24, 24], [24, 20, 20]
                text.update(model_type=f"{arch}_text", rope_parameters={
                    "rope_type": "default", "rope_theta": text.get("rope_theta", 10000.0),
                    "mrope_section": [half - 2 * side, side, side]})
                vision = {"depth": 2, "hidden_size": 256, "intermediate_size": 512, "num_heads": 4,
                          "out_hidden_size": text["hidden_size"]}
                vision.update({"fullatt_block_indexes": [1]} if arch == "qwen2_5_vl" else
                              {"patch_size": 14, "num_position_embeddings": 256, "deepstack_visual_indexes": [0]})
                name = "Qwen2_5_VL" if arch == "qwen2_5_vl" else "Qwen3VL"
                config = {"architectures": [f"{name}ForConditionalGeneration"], "model_type": arch,
                          "text_config": text, "vision_config": vision, "image_token_id": 10,
                          "vision_start_token_id": 8, "vision_end_token_id": 9}
                Qwen2VLImageProcessorPil(max_pixels=224 * 224).save_pretrained(out)
            (out / "config.json").write_text(json.dumps(config))
            prompt = {"prompt": f"Compare {image} with {image} in a word:", "multi_modal_data": {"image": images}}
            runs, held = [], ""
            for device in devices:
                llm = LLM(str(out), dtype="float32", device=device, max_model_len=2048, load_format="dummy",
                          **SMALL)
                llm.engine.add_request("held", prompt, params)  # where a running request's embeddings rest
                llm.engine.step()
                held = str(llm.engine.runner.image_embeds.rows("held", 0, 2048, 0)[1].device)  # type: ignore[index]
                while llm.engine.has_unfinished_requests():
                    llm.engine.step()
                runs.append([llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids])
        lines.append(f"greedy {arch} images {devices[1]} vs {devices[0]} float32 {_compare(runs[0], runs[1])}"
                     f"  embeddings held on {held}")
    return lines


def check_whisper_vs_cpu(model: str | None, devices: tuple[str, str] = ("cpu", "cuda"), num_tokens: int = 16
                         ) -> list[str]:
    """A small random Whisper (2 + 2 layers of width 64, 16 mel bins, a 1 s window; the model's
    tokenizer with Whisper's special tokens and 51 timestamps added) greedy on two clips, with
    and without timestamps (its timestamp rules), on CUDA against the CPU path in float32: its
    self-attention through the step's backend, its cross-attention over the slots' keys and
    values; and the token timestamps (its alignment heads' cross-attention, time-warped)."""
    import json
    import shutil
    import tempfile
    from pathlib import Path

    import numpy as np
    from transformers import (
        AutoTokenizer,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
    )

    from worker import LLM, SamplingParams
    from worker.model_executor.model_loader import resolve_model_path

    special = ["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|translate|>", "<|startofprev|>",
               "<|notimestamps|>", *(f"<|{k * 0.02:.2f}|>" for k in range(51))]
    rng = np.random.default_rng(0)
    clips = [(rng.normal(0, 0.1, int(seconds * 16000)).astype(np.float32), 16000) for seconds in (0.4, 0.9)]
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True,
                            extra_args={"token_timestamps": True})
    with tempfile.TemporaryDirectory() as tmp:
        out, source = Path(tmp), resolve_model_path(model)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(source / name, out / name)
        tokenizer = AutoTokenizer.from_pretrained(out)
        tokenizer.add_special_tokens({"additional_special_tokens": special})
        tokenizer.chat_template = None
        tokenizer.save_pretrained(out)
        torch.manual_seed(0)
        config = WhisperConfig(vocab_size=len(tokenizer), num_mel_bins=16, d_model=64, encoder_layers=2,
                               decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                               encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=50,
                               max_target_positions=64, init_std=0.3, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
                               decoder_start_token_id=tokenizer.convert_tokens_to_ids(special[0]))
        WhisperForConditionalGeneration(config).save_pretrained(out)
        WhisperFeatureExtractor(feature_size=16, chunk_length=1).save_pretrained(out)
        generation = json.loads((out / "generation_config.json").read_text())
        generation.update(no_timestamps_token_id=tokenizer.convert_tokens_to_ids("<|notimestamps|>"),
                          begin_suppress_tokens=[], max_initial_timestamp_index=10,
                          alignment_heads=[[0, 1], [1, 0], [1, 3]])
        (out / "generation_config.json").write_text(json.dumps(generation))
        runs, times = [], []
        for device in devices:
            llm = LLM(str(out), dtype="float32", device=device, max_model_len=64, **SMALL)
            prompts = [{"prompt": "<|startoftranscript|><|en|><|transcribe|>" + ("" if timed else "<|notimestamps|>"),
                        "multi_modal_data": {"audio": clip}} for clip in clips for timed in (False, True)]
            outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
            runs.append([o.token_ids for o in outputs])
            times.append([o.token_timestamps for o in outputs])
            del llm
    return [f"greedy whisper {devices[1]} vs {devices[0]} float32 (clips x timestamps) {_compare(runs[0], runs[1])}",
            f"whisper token timestamps {devices[1]} vs {devices[0]}: identical "
            f"{sum(a == b for a, b in zip(*times, strict=True))}/{len(times[0])}"]


def _compare(a: list[list[int]], b: list[list[int]]) -> str:
    same = sum(x == y for x, y in zip(a, b, strict=True))
    return f"identical {same}/{len(a)}  common prefix {[_common_prefix(x, y) for x, y in zip(a, b, strict=True)]}"


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def check_w1(model: str | None, load_format: str, num_prompts: int) -> list[str]:
    from worker.benchmarks.throughput import run_engine, run_hf
    from worker.benchmarks.workload import RandomWorkload

    workload = RandomWorkload(num_prompts=num_prompts)
    args = {"device": "cuda", "max_model_len": 2048, "max_num_seqs": 256, "load_format": load_format}
    graphs = run_engine(model, "bfloat16", workload, args)["output_tokens_per_s"]
    torch.cuda.empty_cache()
    eager = run_engine(model, "bfloat16", workload, {**args, "enforce_eager": True})["output_tokens_per_s"]
    torch.cuda.empty_cache()
    fp8 = run_engine(model, "bfloat16", workload, {**args, "quantization": "fp8"})["output_tokens_per_s"]
    torch.cuda.empty_cache()
    overlapped = run_engine(model, "bfloat16", workload, {**args, "async_scheduling": True})["output_tokens_per_s"]
    torch.cuda.empty_cache()
    hf = run_hf(model, "bfloat16", workload, batch_size=32, device="cuda", load_format=load_format)
    hf = hf["output_tokens_per_s"]
    return [
        f"W1 engine (cuda, bf16, graphs) {graphs:>10.1f} out tok/s",
        f"W1 engine (cuda, bf16, eager)  {eager:>10.1f} out tok/s",
        f"W1 engine (cuda, fp8 weights)  {fp8:>10.1f} out tok/s",
        f"W1 engine (graphs, async)      {overlapped:>10.1f} out tok/s",
        f"W1 transformers (cuda, bf16)   {hf:>10.1f} out tok/s",
        f"W1 ratio engine / hf           {graphs / hf:>10.2f}x",
        f"W1 ratio graphs / eager        {graphs / eager:>10.2f}x",
        f"W1 ratio fp8 / bf16 weights    {fp8 / graphs:>10.2f}x",
        f"W1 ratio async / not           {overlapped / graphs:>10.2f}x",
    ]


def check_kv_offload(model: str | None, load_format: str, device: str = "cuda", num_tokens: int = 16) -> list[str]:
    """KV offloading on the device: a 400-token prompt's cached blocks, pushed out of a
    48-block pool by a 600-token one, come back from pinned host memory; its greedy tokens the
    second time equal the first's (float32)."""
    import random

    from worker import LLM, SamplingParams

    rng = random.Random(0)
    first, other = ([rng.randrange(3, 49152) for _ in range(n)] for n in (400, 600))
    llm = LLM(model, dtype="float32", device=device, load_format=load_format, max_model_len=768,
              num_gpu_blocks_override=48, kv_offloading_size=0.25, max_num_seqs=SMALL["max_num_seqs"])
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    runs = [llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0] for ids in (first, other, first)]
    stats = llm.engine.block_manager.stats
    return [f"kv offloading on {device}: {runs[2].num_cached_tokens} of {len(first)} prompt tokens cached the second "
            f"time, {stats.host_hits} from host memory; greedy "
            f"{_compare([runs[0].outputs[0].token_ids], [runs[2].outputs[0].token_ids])}"]


def check_sleep_and_reload(model: str | None, load_format: str, device: str = "cuda", num_tokens: int = 16
                           ) -> list[str]:
    """Weights updates and sleep mode on the device, decode graphs on: the served checkpoint read
    again (reload_weights) gives the same greedy tokens; a level-1 sleep gives back the KV pool's
    memory, level 2 the weights' too; woken, the same tokens (bfloat16). With dummy weights,
    seeded random ones are saved first as the checkpoint to serve and read again."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        if load_format == "dummy":
            model, load_format = _save_random_checkpoint(model, tmp), "auto"
        return _sleep_and_reload(model, load_format, device, num_tokens)


def _save_random_checkpoint(model: str | None, out_dir: str) -> str:
    """The model's config and tokenizer with seeded random bfloat16 weights, saved in `out_dir`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    remake(model, None, out_dir)
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(out_dir)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out_dir)
    return out_dir


def _sleep_and_reload(model: str | None, load_format: str, device: str, num_tokens: int) -> list[str]:
    from worker import LLM, SamplingParams

    llm = LLM(model, dtype="bfloat16", device=device, load_format=load_format, max_model_len=1024,
              num_gpu_blocks_override=4096, max_num_seqs=SMALL["max_num_seqs"])
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)

    def run() -> list[int]:
        return llm.generate({"prompt_token_ids": list(range(100, 300))}, params, use_tqdm=False)[0].outputs[0].token_ids

    def allocated() -> int:
        if device != "cuda":
            return 0
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    first = run()
    llm.reload_weights()
    reloaded = run()
    held = allocated()
    llm.sleep(level=1)
    freed_1 = held - allocated()
    llm.wake_up()
    woken_1 = run()
    llm.sleep(level=2)
    freed_2 = held - allocated()
    llm.wake_up()
    woken_2 = run()
    pool = llm.engine.runner.kv_pool
    mib = 2**20
    return [f"sleep on {device}: level 1 gave back {freed_1 / mib:.0f} MiB (KV pool {pool.numel() * pool.element_size() / mib:.0f}"
            f" MiB), level 2 {freed_2 / mib:.0f} MiB; greedy after waking: level 1 {_compare([reloaded], [woken_1])}, "
            f"level 2 {_compare([reloaded], [woken_2])}; reload_weights of the served checkpoint "
            f"{_compare([first], [reloaded])}"]


def write_eagle3_head(target_dir: str) -> str:
    """The config of an EAGLE-3 head for the model at `target_dir` (a one-layer Llama of its
    width, reading its default aux layers), written beside it in `head/`; load it with
    load_format="dummy"."""
    import json
    from pathlib import Path

    target = json.loads((Path(target_dir) / "config.json").read_text())
    head = Path(target_dir) / "head"
    head.mkdir(exist_ok=True)
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings", "hidden_act")
    (head / "config.json").write_text(json.dumps({
        **{k: target[k] for k in keep if k in target}, "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama", "num_hidden_layers": 1, "tie_word_embeddings": False}))
    return str(head)


def check_draft_layer_vs_cpu(model: str | None, method: str, devices: tuple[str, str] = ("cpu", "cuda"),
                             num_tokens: int = 24) -> list[str]:
    """A draft layer that reads the target's hidden states, seeded random weights: the model's
    shape remade as a DeepSeek-V3 guessing with its MTP layer (`method` mtp), or as a Qwen3
    with an EAGLE-3 head of its width (eagle3). Every step's guesses and the outputs on CUDA
    against CPU, float32; then with the target's and the draft's final norms zeroed (both
    always pick token 0), the share of guesses kept on CUDA."""
    import tempfile

    from worker import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    prompts = ["Hello, my name is", "1, 2, 3,"]
    with tempfile.TemporaryDirectory() as tmp:
        arch = "deepseek_v3" if method == "mtp" else "qwen3"
        remade = remake(model, arch, tmp)
        spec: dict = {"method": method, "num_speculative_tokens": 2}
        if method == "eagle3":
            spec["model"] = write_eagle3_head(remade)
        runs, lines = [], []
        for device in devices:
            llm = LLM(remade, dtype="float32", device=device, max_model_len=2048, load_format="dummy",
                      speculative_config=spec, **SMALL)
            engine, steps = llm.engine, []
            for i, prompt in enumerate(prompts):
                engine.add_request(str(i), prompt, params)
            while engine.has_unfinished_requests():
                engine.step()
                steps.append(sorted((r.request_id, r.all_token_ids, r.spec_token_ids) for r in engine.scheduler.running))
            runs.append(steps)
        lines.append(f"{method} {arch} {devices[1]} vs {devices[0]} guesses and outputs float32: "
                     f"{'equal' if runs[0] == runs[1] else 'DIFFER'} ({sum(len(s) for s in runs[0])} request steps)")
        for runner in (engine.runner, engine.speculator.proposer.runner):
            runner.model.norm.weight.data.zero_()
        before = (engine.speculator.stats.num_draft_tokens, engine.speculator.stats.num_accepted_tokens)
        outs = llm.generate(prompts, params, use_tqdm=False)
        drafted, kept = (now - then for now, then in zip((engine.speculator.stats.num_draft_tokens,
                                                          engine.speculator.stats.num_accepted_tokens), before, strict=True))
        zeros = all(o.outputs[0].token_ids == [0] * num_tokens for o in outs)
        lines.append(f"{method} {arch} {devices[1]} every guess right: {kept}/{drafted} kept, outputs all 0: {zeros}")
    return lines


def check_state_paths() -> list[str]:
    """One Gated DeltaNet layer of Qwen3.5's size: torch path against kernel path."""
    from linear_attention import paths  # benchmarks/linear_attention.py, beside this script

    with torch.inference_mode():
        return paths(torch.device("cuda"))


def _section(name: str, check: Callable[[], list[str]]) -> list[str]:
    """One part of the check; a failure becomes a line of the table, not the end of the run."""
    try:
        lines = check()
    except Exception as exc:  # noqa: BLE001 (any failure is a result to report)
        traceback.print_exc()
        lines = [f"{name}: FAILED: {type(exc).__name__}: {exc}"]
    print("\n".join(lines), flush=True)
    return lines


def _release() -> None:
    """Free what the last part's engines held on the device before the next part sizes its KV
    pool from the memory that is free."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def _kernel_rows() -> list[str]:
    from kernels.bench import check_kernels, format_rows

    rows = check_kernels()
    print(format_rows(rows), flush=True)
    bad = [r for r in rows if not r.get("ok", True)]
    return [f"kernels: {len(rows) - len(bad)}/{len(rows)} match their references"]


def sections(args: argparse.Namespace) -> list[tuple[str, Callable[[], list[str]]]]:
    """The parts in the order they run: what the issue asks for first (kernels, greedy CUDA
    against CPU and graphs against eager, W1), then the other paths on the device."""
    model, load_format = args.model, args.load_format
    parts: list[tuple[str, Callable[[], list[str]]]] = [
        ("kernels", _kernel_rows),
        ("greedy", lambda: check_engine_vs_cpu(model, load_format)),
        ("W1", lambda: check_w1(model, load_format, args.num_prompts)),
        ("lora", lambda: check_lora_vs_cpu(model, load_format)),
        ("embed", lambda: check_embed_vs_cpu(model, load_format)),
        ("kv offloading", lambda: check_kv_offload(model, load_format)),
        ("sleep and reload", lambda: check_sleep_and_reload(model, load_format)),
    ]
    parts += [(arch, lambda arch=arch: check_remade_vs_cpu(model, arch)) for arch in REMADE]
    parts += [("state layer paths", check_state_paths),
              ("images", lambda: check_images_vs_cpu(model)),
              ("whisper", lambda: check_whisper_vs_cpu(model)),
              ("tensor parallel", lambda: check_tensor_parallel(model))]
    parts += [(method, lambda method=method: check_draft_layer_vs_cpu(model, method)) for method in ("mtp", "eagle3")]
    return parts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--model", default=None, help="local model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="dummy: seeded random weights of the model's shape (no checkpoint needed)")
    ap.add_argument("--budget-s", type=float, default=270.0,
                    help="start no part after this many seconds (those left are listed as not run)")
    ap.add_argument("--only", default=None, help="comma-separated names of the parts to run (default: all)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: the GPU check needs one", file=sys.stderr)
        return 2
    start = time.time()
    summary = [f"device: {torch.cuda.get_device_name()}", f"model: {args.model or 'default'} ({args.load_format} weights)"]
    chosen = sections(args)
    if args.skip_kernels:
        chosen = [(name, check) for name, check in chosen if name != "kernels"]
    if args.only:
        wanted = {name.strip() for name in args.only.split(",")}
        unknown = wanted - {name for name, _ in chosen}
        if unknown:
            ap.error(f"--only: no parts named {sorted(unknown)}; the parts are {[name for name, _ in chosen]}")
        chosen = [(name, check) for name, check in chosen if name in wanted]
    not_run = []
    for name, check in chosen:
        if time.time() - start > args.budget_s:
            not_run.append(name)
            continue
        began = time.time()
        summary += _section(name, check)
        print(f"[{name}: {time.time() - began:.0f} s]", flush=True)
        _release()
    if not_run:
        summary.append(f"not run (past the {args.budget_s:.0f} s budget): {', '.join(not_run)}")
    summary.append(f"elapsed {time.time() - start:.0f} s")
    print("\n".join(["", "== GPU check ==", *summary]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
