"""DeepSeek's latent attention beyond greedy parity (tests/worker/test_engine.py has that, over
the tiny DeepSeek-V2 and V3 of `tiny_moe_dir`): what the cache holds, and what is refused."""

from __future__ import annotations

import json

import pytest
import torch
from test_engine import check_prefill_logits_against, run_and_compare
from test_quantization import write_fp8_checkpoint

from producer.sampling_params import SamplingParams
from worker import LLM


@pytest.mark.parametrize("tiny_moe_dir", ["deepseek_v3"], indirect=True)
def test_the_cache_holds_one_latent_and_rope_key_per_token(tiny_moe_dir):
    """A layer's keys and values share one pool of [latent | RoPE key] rows, one head wide,
    and blocks are counted so: a token costs kv_lora_rank + qk_rope_head_dim values a layer,
    where expanded keys and values would cost heads * (nope + rope + v)."""
    cfg = json.loads((tiny_moe_dir / "config.json").read_text())
    llm = LLM(str(tiny_moe_dir), dtype="bfloat16", num_gpu_blocks_override=64)
    runner = llm.engine.runner
    width = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    for k_cache, v_cache in runner.kv_caches:
        assert k_cache.data_ptr() == v_cache.data_ptr()
        assert k_cache.shape[-1] == width and k_cache.numel() == 64 * runner.block_size * width
    assert runner._kv_block_bytes() == cfg["num_hidden_layers"] * runner.block_size * width * 2
    out = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("tiny_moe_dir", ["deepseek_v2"], indirect=True)
def test_lora_is_refused_by_name(tiny_moe_dir):
    with pytest.raises(ValueError, match=r"LoRA adapters are not supported for DeepseekV2ForCausalLM.*latent attention"):
        LLM(str(tiny_moe_dir), dtype="float32", num_gpu_blocks_override=16, enable_lora=True)


@pytest.mark.parametrize("tiny_moe_dir", ["deepseek_v3"], indirect=True)
def test_fp8_block_checkpoints_load_as_deepseek_ships_them(tiny_moe_dir, tmp_path):
    """Every projection stored in fp8 with a scale per 8 x 8 block (DeepSeek-V3's own
    checkpoints use 128 x 128): the latent projections are widened as they load, and the
    logits are transformers' on the same checkpoint."""
    fp8_dir = write_fp8_checkpoint(tiny_moe_dir, tmp_path / "fp8", (8, 8))
    llm = check_prefill_logits_against(fp8_dir, fp8_dir, "torch")
    kv_b_proj = llm.engine.runner.model.layers[0].self_attn.kv_b_proj.weight
    assert kv_b_proj.dtype == torch.float32


@pytest.mark.parametrize("tiny_moe_dir", ["glm4_moe_lite"], indirect=True)
def test_glm_4_7_flash_greedy_matches_transformers(tiny_moe_dir):
    """GLM-4.7-Flash: DeepSeek-V3's latent attention and routing, with its layers' MLP kinds
    named in mlp_layer_types (experts first here, then a dense MLP)."""
    llm = LLM(str(tiny_moe_dir), dtype="float32", num_gpu_blocks_override=256)
    assert [type(layer.mlp).__name__ for layer in llm.engine.runner.model.layers] == ["SparseMoeBlock", "MLP"]
    run_and_compare(llm, tiny_moe_dir)
