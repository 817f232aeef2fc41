"""Sleep mode (LLM.sleep, LLM.wake_up), as a trainer sharing the device uses vLLM's: the KV
cache's memory goes back (level 2: the weights' too), requests are refused meanwhile, and
woken the engine writes the tokens it wrote before, or those of the weights loaded while it
slept."""

from __future__ import annotations

import pytest
from test_engine import hf_greedy_along

from producer.sampling_params import SamplingParams
from worker import LLM

PROMPTS = [list(range(5, 41)), [40, 41, 42, 43, 44]]


def tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in
            llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params, use_tqdm=False)]


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])  # (qwen3_5: linear attention's states sleep too)
def test_level_1_gives_the_kv_cache_back_and_wakes_as_before(tiny_family, family):
    llm = LLM(str(tiny_family(family)), dtype="float32", num_gpu_blocks_override=16384)
    pool = llm.engine.runner.kv_pool
    before = tokens(llm)
    resident = resident_bytes()
    llm.sleep()
    assert llm.engine.weights.is_sleeping()
    assert resident - resident_bytes() > 0.8 * pool.numel() * pool.element_size()  # its pages went back
    with pytest.raises(ValueError, match=r"asleep \(sleep mode\): wake_up\(\) first"):
        tokens(llm)
    llm.wake_up()
    assert not llm.engine.weights.is_sleeping() and tokens(llm) == before


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_level_2_forgets_the_weights_and_wakes_with_those_loaded_meanwhile(tiny_llama_dir, retrained_llama_dir,
                                                                         backend):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, attention_backend=backend)
    before = tokens(llm)
    llm.sleep(level=2)
    assert llm.engine.runner.model.embed_tokens.weight.untyped_storage().nbytes() == 0
    llm.wake_up()  # the checkpoint served, read again
    assert tokens(llm) == before
    # a trainer's turn: the weights wake alone, new ones are loaded, then the cache wakes
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    llm.reload_weights(retrained_llama_dir)
    assert llm.engine.weights.is_sleeping()  # (the cache still is)
    llm.wake_up(tags=["kv_cache"])
    after = tokens(llm)
    assert after == hf_greedy_along(retrained_llama_dir, PROMPTS, after)


def test_only_an_idle_engine_sleeps_and_bad_arguments_are_named(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    llm.engine.add_request("running", {"prompt_token_ids": PROMPTS[1]}, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="only an idle engine sleeps: 1 requests are unfinished"):
        llm.sleep()
    with pytest.raises(ValueError, match="sleep level must be 1"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match=r"tags are 'weights' and 'kv_cache', got \['kv'\]"):
        llm.wake_up(tags=["kv"])
