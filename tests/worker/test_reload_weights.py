"""Weights updates (LLM.reload_weights): after one, the engine's greedy tokens are those
transformers writes with the new checkpoint, whatever the prefix cache held; a checkpoint that
does not fit is refused by name and the weights stay as they were."""

from __future__ import annotations

import shutil

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from test_engine import greedy_along, hf_greedy_along
from test_mtp import PROMPTS as MTP_PROMPTS
from test_mtp import HfMtp, build_mtp_checkpoint, run_checking_guesses
from test_qwen_vl_images import ONE, _generate, hf_greedy
from transformers import AutoModelForCausalLM

from producer.sampling_params import SamplingParams
from worker import LLM, LoRARequest

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24], [40, 41, 42, 43, 44]]


def greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def tokens(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], greedy(), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_the_new_weights_are_served_and_nothing_cached_before_is(tiny_llama_dir, retrained_llama_dir):
    """(On the Triton path, decode graphs and all: test_sleep's level-2 test, which reloads too.)"""
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    before = tokens(llm)  # (its prompts' blocks are cached now)
    assert llm.reload_weights(retrained_llama_dir) == retrained_llama_dir
    after = tokens(llm)
    assert after != before  # the update shows
    assert after == hf_greedy_along(retrained_llama_dir, PROMPTS, after)
    assert llm.reload_weights() == tiny_llama_dir  # the served checkpoint, read again
    assert tokens(llm) == before


def test_weights_given_in_memory_are_served(tiny_llama_dir, retrained_llama_dir):
    """A colocated trainer's `named_parameters()`, as transformers names them; all or nothing."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    trained = AutoModelForCausalLM.from_pretrained(retrained_llama_dir, dtype=torch.float32)
    assert llm.reload_weights(weights=trained.named_parameters()) is None
    after = tokens(llm)
    assert after == greedy_along(trained, PROMPTS, after)
    short = dict(AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).named_parameters())
    del short["model.norm.weight"]
    with pytest.raises(ValueError, match="missing weights: norm.weight"):
        llm.reload_weights(weights=short.items())
    with pytest.raises(ValueError, match="a checkpoint's path or its weights, not both"):
        llm.reload_weights(tiny_llama_dir, weights=short.items())
    assert tokens(llm) == after


def test_a_running_request_keeps_its_blocks_but_no_later_request_hits_them(tiny_llama_dir, retrained_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    engine = llm.engine
    engine.add_request("old", {"prompt_token_ids": PROMPTS[0]}, greedy(12))
    # its prompt's blocks are computed, and cached, under the old weights
    done: dict[str, list[int]] = {"old": list(engine.step()[0].outputs[0].token_ids), "new": []}
    llm.reload_weights(retrained_llama_dir)
    engine.add_request("new", {"prompt_token_ids": PROMPTS[0]}, greedy())
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] += out.outputs[0].token_ids
    assert len(done["old"]) == 12  # it ran on to its end, over the new weights
    assert done["new"] == hf_greedy_along(retrained_llama_dir, PROMPTS[:1], [done["new"]])[0]


def test_a_checkpoint_that_does_not_fit_is_refused_and_the_weights_stay(tiny_llama_dir, tiny_mistral_dir, tmp_path):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    before = tokens(llm)
    with pytest.raises(ValueError, match=r"not a checkpoint of the served model's shape: architecture "
                                         r"'MistralForCausalLM' \(served: 'LlamaForCausalLM'\), "
                                         r"num_key_value_heads 4 \(served: 2\)"):
        llm.reload_weights(tiny_mistral_dir)
    with pytest.raises(ValueError, match="not a local model directory"):
        llm.reload_weights(tmp_path / "nowhere")
    # the same config, a tensor short or a tensor of another shape: found as the checkpoint is read
    for name, change in (("short", lambda w: w.pop("model.layers.1.mlp.down_proj.weight")),
                         ("wide", lambda w: w.update({"lm_head.weight": w["lm_head.weight"][:, :-1].clone()}))):
        bad = tmp_path / name
        shutil.copytree(tiny_llama_dir, bad)
        weights = load_file(bad / "model.safetensors")
        change(weights)
        save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match="down_proj" if name == "short" else "lm_head"):
            llm.reload_weights(bad)
    assert tokens(llm) == before


def test_an_mtp_layer_is_read_from_the_new_checkpoint_too(tiny_family, retrain, tmp_path):
    """The target's own MTP layer guesses from the new checkpoint's weights (and the target's
    new embedding and head, which it shares): each guess is transformers' from the new one."""
    family = "deepseek_v3"
    old = build_mtp_checkpoint(tiny_family(family), tmp_path / "old", family)
    new = build_mtp_checkpoint(retrain(tiny_family(family), tmp_path / "base"), tmp_path / "new", family, seed=2)
    llm = LLM(str(old), dtype="float32", num_gpu_blocks_override=64, max_model_len=128,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    llm.reload_weights(new)
    hf, params = HfMtp(new, family), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    run_checking_guesses(llm, hf, MTP_PROMPTS, params)
    llm.sleep(level=2)  # (the layer's weights forgotten too, and read again from the checkpoint served last)
    llm.wake_up()
    run_checking_guesses(llm, hf, MTP_PROMPTS, params)


def test_every_tensor_parallel_rank_reads_its_share(tiny_llama_dir, retrained_llama_dir, tmp_path):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, num_threads=1,
              tensor_parallel_size=2)
    llm.reload_weights(retrained_llama_dir)
    after = tokens(llm)
    assert after == hf_greedy_along(retrained_llama_dir, PROMPTS, after)
    bad = tmp_path / "bad"
    shutil.copytree(retrained_llama_dir, bad)
    weights = load_file(bad / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj"):
        llm.reload_weights(bad)
    assert tokens(llm) == after  # (and rank 1 serves on, its weights kept too)
    with pytest.raises(ValueError, match="with tensor_parallel_size 2, save them as a checkpoint"):
        llm.reload_weights(weights=weights.items())
    llm.sleep(level=2)  # (sleep mode on every rank: each reads its share again as it wakes)
    llm.wake_up()
    assert tokens(llm) == after


def test_an_image_encoder_is_read_from_the_new_checkpoint_too(tiny_qwen_vl_dir, retrain, tmp_path):
    """The vision tower's weights change with the rest, and no image is served from the
    embeddings the old tower made (the same picture, asked about again)."""
    new = retrain(tiny_qwen_vl_dir, tmp_path / "new")
    llm = LLM(str(tiny_qwen_vl_dir), dtype="float32", num_gpu_blocks_override=64)
    before = _generate(llm, [ONE])[0].outputs[0].token_ids
    llm.reload_weights(new)
    after = _generate(llm, [ONE])[0].outputs[0].token_ids
    assert after != before and after == hf_greedy(new, *ONE)
    with pytest.raises(ValueError, match="encoder reads its weights from a checkpoint"):
        llm.reload_weights(weights=load_file(new / "model.safetensors").items())


def test_a_loaded_adapter_applies_over_the_new_weights(tiny_llama_dir, retrained_llama_dir, tiny_llama_adapters):
    """An adapter made resident before the update is served over the new base weights, as PEFT
    applies it to the new checkpoint."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, enable_lora=True, max_lora_rank=8)
    adapter = LoRARequest("all", 1, str(tiny_llama_adapters["all"]))
    params = greedy()
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    llm.generate(prompts, params, lora_request=adapter, use_tqdm=False)
    llm.reload_weights(retrained_llama_dir)
    outs = llm.generate(prompts, params, lora_request=adapter, use_tqdm=False)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(retrained_llama_dir, dtype=torch.float32),
                                      tiny_llama_adapters["all"])
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == greedy_along(model, PROMPTS, got)
    llm.sleep(level=2)  # (the adapter's slot, which no weights load writes, keeps it)
    llm.wake_up()
    again = llm.generate(prompts, params, lora_request=adapter, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in again] == got
