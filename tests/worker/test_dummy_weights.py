"""load_format="dummy": seeded random weights of a config's shape, for benchmarks on machines a
checkpoint cannot reach (the device check). No checkpoint is read, and every engine, on any
path, starts from the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from producer.sampling_params import SamplingParams
from worker import LLM

PROMPTS = ["Hello, my name is", "The capital of France is", "x"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_dummy_weights_are_seeded_and_shaped_by_the_config(shape_only: Path):
    with pytest.raises(ValueError, match="no .safetensors files"):
        LLM(str(shape_only), dtype="float32", num_gpu_blocks_override=64)
    llm = LLM(str(shape_only), dtype="float32", load_format="dummy", num_gpu_blocks_override=64)
    model = llm.engine.runner.model
    embed = model.embed_tokens.weight.detach()
    assert abs(float(embed.std()) - 0.3) < 0.003 and abs(float(embed.mean())) < 0.003  # initializer_range
    assert torch.equal(model.layers[0].input_layernorm.weight, torch.ones(64))
    eye = torch.eye(64)  # a layer's outputs for the unit vectors: its weight, packed for oneDNN or not
    assert not torch.equal(model.layers[0].self_attn.qkv_proj(eye), model.layers[1].self_attn.qkv_proj(eye))
    again = LLM(str(shape_only), dtype="float32", load_format="dummy", num_gpu_blocks_override=64)
    assert greedy(llm) == greedy(again)


def test_dummy_weights_are_the_same_on_the_kernel_path(shape_only: Path):
    """The triton backend (the CUDA path; here under TRITON_INTERPRET) draws the same weights,
    so its greedy tokens are the torch path's."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_path = LLM(str(shape_only), dtype="float32", load_format="dummy", num_gpu_blocks_override=64)
    kernel_path = LLM(str(shape_only), dtype="float32", load_format="dummy", num_gpu_blocks_override=64,
                      device=device, attention_backend="triton")
    assert greedy(torch_path) == greedy(kernel_path)


def test_load_format_is_checked():
    with pytest.raises(ValueError, match="load_format must be auto or dummy"):
        LLM(load_format="random")
