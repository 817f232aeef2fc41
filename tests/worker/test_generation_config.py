"""vLLM's generation_config: the sampling values of a model's generation_config.json are
what requests that leave them unset sample with (here top_k 1, so sampling is greedy, and a
repetition penalty), against the same values given explicitly."""

from __future__ import annotations

import json
import shutil

import pytest

from producer.sampling_params import SamplingParams
from worker import LLM


def test_unset_sampling_takes_the_models_generation_config(tuned_llama_dir, tiny_llama_dir):
    llm = LLM(str(tuned_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.repetition_penalty, defaults.top_p,
            defaults.max_tokens) == (0.9, 1, 1.5, 1.0, 20)
    prompt = {"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}
    unset = llm.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids  # no params: the model's
    given = SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.5)
    assert len(unset) == 20 and unset == llm.generate(prompt, given, use_tqdm=False)[0].outputs[0].token_ids
    plain = SamplingParams(temperature=0.0, max_tokens=20)
    assert unset != llm.generate(prompt, plain, use_tqdm=False)[0].outputs[0].token_ids
    # "vllm": vLLM's own defaults; a directory: its generation_config.json
    assert LLM(str(tuned_llama_dir), num_gpu_blocks_override=64, generation_config="vllm").engine.sampling_defaults == {}
    other = LLM(str(tiny_llama_dir), num_gpu_blocks_override=64, generation_config=str(tuned_llama_dir))
    assert other.engine.sampling_defaults == {"temperature": 0.9, "top_k": 1, "repetition_penalty": 1.5,
                                              "max_tokens": 20}


def test_a_generation_config_sampling_refuses_is_named(tiny_llama_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama_dir, bad)
    (bad / "generation_config.json").write_text(json.dumps({"top_p": 2.0}))
    with pytest.raises(ValueError, match=r"generation_config.json: top_p must be in \(0, 1\]"):
        LLM(str(bad), num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="holds no generation_config.json"):
        LLM(str(tiny_llama_dir), num_gpu_blocks_override=64, generation_config=str(tmp_path))


def test_an_override_replaces_or_adds_to_the_generation_config(tuned_llama_dir):
    """vLLM's override_generation_config: over the model's values ("auto"), or alone ("vllm");
    a key it does not take, or a value SamplingParams refuses, is named."""
    override = {"temperature": 0.5, "max_new_tokens": 7, "min_p": 0.1}
    llm = LLM(str(tuned_llama_dir), num_gpu_blocks_override=64, override_generation_config=override)
    assert llm.engine.sampling_defaults == {"temperature": 0.5, "top_k": 1, "repetition_penalty": 1.5, "min_p": 0.1,
                                            "max_tokens": 7}
    prompt = {"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}
    assert len(llm.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids) == 7  # requests that leave it unset
    alone = LLM(str(tuned_llama_dir), num_gpu_blocks_override=64, generation_config="vllm",
                override_generation_config={"top_p": 0.8})
    assert alone.engine.sampling_defaults == {"top_p": 0.8}
    with pytest.raises(ValueError, match="override_generation_config takes temperature.*got 'beams'"):
        LLM(str(tuned_llama_dir), num_gpu_blocks_override=64, override_generation_config={"beams": 2})
    with pytest.raises(ValueError, match="top_p must be in"):
        LLM(str(tuned_llama_dir), num_gpu_blocks_override=64, override_generation_config={"top_p": 3})
