"""vLLM's hf_overrides: entries of a model's config.json replaced before it is read, here
YaRN on a tiny Qwen3 (as Qwen3's own instructions extend its context), against transformers
running the same weights under the same overridden config."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from producer.sampling_params import SamplingParams
from worker import LLM

YARN = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        "max_position_embeddings": 4096}


def test_yarn_by_override_is_transformers_yarn(tiny_family):
    model_dir = tiny_family("qwen3")
    values = {**json.loads((model_dir / "config.json").read_text()), **YARN}
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    assert config.rope_parameters["rope_type"] == "yarn"
    hf = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32)
    prompt = [(7 * i) % 900 + 3 for i in range(100)]  # past the original 64 positions
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, 100:]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=256, hf_overrides=YARN)
    assert llm.engine.max_model_len == 4096  # the overridden max_position_embeddings
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert out == expected.tolist()
    plain = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64)
    assert plain.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids != out


def test_hf_overrides_must_be_a_mapping():
    with pytest.raises(ValueError, match="hf_overrides must be a mapping of config.json entries"):
        LLM(hf_overrides=["rope_scaling"])
