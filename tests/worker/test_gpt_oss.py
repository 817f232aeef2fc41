"""gpt-oss beyond greedy parity on float weights (tests/worker/test_engine.py has that): OpenAI's
MXFP4 checkpoints, whose experts widen to the model's dtype as they load, against transformers
reading the same files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine import PROMPTS, greedy, hf_greedy, run_and_compare

from worker import LLM
from worker.model_executor.models.gpt_oss import dequantize_mxfp4
from worker.model_executor.models.quant import E2M1

GRID = torch.tensor(E2M1[:8])  # the non-negative e2m1 values


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., cols] float -> blocks [..., cols / 32, 16] uint8 and scales [..., cols / 32] uint8:
    each group of 32 scaled by a power of two that brings its largest value within 6, each
    value rounded to the nearest e2m1 code (low nibble first), as OpenAI's checkpoints hold them."""
    groups = w.float().unflatten(-1, (-1, 32))  # [..., G, 32]
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0))  # [..., G, 1]
    scaled = groups / torch.exp2(exponent)
    codes = (scaled.abs()[..., None] - GRID).abs().argmin(-1)  # [..., G, 32] in 0..7
    codes = codes + 8 * (scaled < 0)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent[..., 0] + 127).to(torch.uint8)


def write_mxfp4_checkpoint(float_dir: Path, out: Path) -> Path:
    """The float gpt-oss checkpoint with its experts in MXFP4 (OpenAI's layout: rows are each
    projection's outputs, the interleaved gate/up columns of transformers' layout becoming rows)."""
    for path in float_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
    tensors = load_file(float_dir / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2))  # [E, outputs, inputs]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks.contiguous(), scales.contiguous()
    save_file(tensors, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_mxfp4_codes_and_scales_widen_exactly():
    codes = torch.arange(16, dtype=torch.uint8)
    blocks = (codes[0::2] | (codes[1::2] << 4)).repeat(2)[None, None]  # one row, one group: all 16 codes twice
    values = dequantize_mxfp4(blocks, torch.tensor([[126]], dtype=torch.uint8))  # scale 2 ** -1
    assert values.tolist() == [[v / 2 for v in E2M1 * 2]]  # [rows, 32]
    with pytest.raises(ValueError, match="MXFP4 blocks .* do not match their scales"):
        dequantize_mxfp4(blocks, torch.tensor([126, 127], dtype=torch.uint8))


@pytest.mark.parametrize("tiny_moe_dir", ["gpt_oss"], indirect=True)
def test_mxfp4_checkpoint_matches_transformers(tiny_moe_dir, tmp_path):
    """Greedy tokens equal transformers' on the same MXFP4 files (which it dequantizes on the
    CPU); rounding to e2m1 changed the weights: the float checkpoint's tokens differ."""
    mxfp4 = write_mxfp4_checkpoint(tiny_moe_dir, tmp_path)
    prompts = PROMPTS[:2]
    outputs = run_and_compare(LLM(str(mxfp4), dtype="float32", num_gpu_blocks_override=256), mxfp4, prompts)
    float_outputs = LLM(str(tiny_moe_dir), dtype="float32", num_gpu_blocks_override=256).generate(
        prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] != [o.outputs[0].token_ids for o in float_outputs]


@pytest.mark.parametrize("tensor_parallel_size, expert_parallel", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("tiny_moe_dir", ["gpt_oss"], indirect=True)
def test_mxfp4_experts_stay_so_on_the_kernel_path(tiny_moe_dir, tmp_path, tensor_parallel_size, expert_parallel):
    """On the kernel path the experts keep their e2m1 codes (a quarter of bf16's bytes) and
    the fused MoE kernel decodes them tile by tile: the same greedy tokens as transformers.
    Split over two ranks, each keeps the codes and exponents of half of every expert's
    features (and its heads' sinks, and the biases), or with expert parallelism those of
    half of the experts, whole."""
    if torch.cuda.is_available() and torch.cuda.device_count() < tensor_parallel_size:
        pytest.skip(f"{tensor_parallel_size} GPUs needed")
    mxfp4 = write_mxfp4_checkpoint(tiny_moe_dir, tmp_path)
    llm = LLM(str(mxfp4), dtype="float32", num_gpu_blocks_override=64, attention_backend="triton",
              device="cuda" if torch.cuda.is_available() else "cpu", tensor_parallel_size=tensor_parallel_size,
              num_threads=1 if tensor_parallel_size > 1 else None, enable_expert_parallel=expert_parallel)
    experts = llm.engine.runner.model.layers[0].mlp.experts
    assert experts.w13.dtype == torch.uint8 and experts.w13_scale.shape[-1] == 64 // 32
    features_split = 1 if expert_parallel else tensor_parallel_size
    assert experts.w2.shape[-1] * 2 * features_split == 64  # its features: two e2m1 codes a byte
    assert experts.w2.shape[0] * (tensor_parallel_size if expert_parallel else 1) == 4  # the experts
    tok = llm.get_tokenizer()
    expected = hf_greedy(mxfp4, [tok.encode(p) for p in PROMPTS[:3]], max_new=8)
    outputs = llm.generate(PROMPTS[:3], greedy(8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("tiny_moe_dir", ["gpt_oss"], indirect=True)
def test_mxfp4_blocks_without_their_scales_are_named(tiny_moe_dir, tmp_path):
    mxfp4 = write_mxfp4_checkpoint(tiny_moe_dir, tmp_path)
    tensors = load_file(mxfp4 / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, mxfp4 / "model.safetensors")
    with pytest.raises(ValueError, match=r"MXFP4 blocks without their scales .*layers\.1\.mlp\.experts\.down_proj_blocks"):
        LLM(str(mxfp4), dtype="float32", num_gpu_blocks_override=16)


def test_mxfp4_is_served_for_gpt_oss_only():
    from transformers import LlamaConfig

    from worker.model_executor.models.config import ModelConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(ValueError, match="quantized with 'mxfp4', which genq does not serve"):
        ModelConfig.from_hf(config)


def test_clamped_swiglu_defaults_where_the_config_names_none():
    """OpenAI's config.json names neither the clamped SwiGLU's alpha nor its limit, and
    transformers' GptOssConfig until a late 5.x reads neither (the GPU check's 5.17 failed on them):
    the model's own 1.702 and 7.0; where named, the config's."""
    from types import SimpleNamespace

    from worker.model_executor.models.config import MoEConfig

    fields = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, num_hidden_layers=2)
    assert MoEConfig.from_hf(SimpleNamespace(**fields), "gpt_oss").clamped_swiglu == (1.702, 7.0)
    named = SimpleNamespace(**fields, swiglu_alpha=1.5, swiglu_limit=5.0)
    assert MoEConfig.from_hf(named, "gpt_oss").clamped_swiglu == (1.5, 5.0)
