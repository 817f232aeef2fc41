"""kv_cache_dtype="fp8": the KV cache holds e4m3 values. The oracle is transformers whose
cache rounds each key and value the same way as it stores them (clamped to +-448, rounded
to nearest), so attention sees them as genq's cache holds them."""

from __future__ import annotations

import pytest
import torch
from test_engine import PROMPTS, check_prefill_logits_against, hf_greedy, run_and_compare

from worker import LLM, SamplingParams


def _as_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype)


@pytest.fixture
def fp8_cache_transformers(monkeypatch):
    """transformers' cache layers store (and hand attention) keys and values rounded to fp8."""
    from transformers.cache_utils import DynamicLayer

    update = DynamicLayer.update
    monkeypatch.setattr(DynamicLayer, "update", lambda self, k, v, *a, **kw: update(self, _as_fp8(k), _as_fp8(v), *a, **kw))


def test_greedy_matches_transformers_with_an_fp8_cache(tiny_llama_dir, fp8_cache_transformers):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=256, kv_cache_dtype="fp8")
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    run_and_compare(llm, tiny_llama_dir)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_logits_match_transformers_with_an_fp8_cache(tiny_llama_dir, fp8_cache_transformers, backend):
    """Chunked prefills reading the cached prefix, on both paths."""
    check_prefill_logits_against(tiny_llama_dir, tiny_llama_dir, backend, {"kv_cache_dtype": "fp8"})


def test_decode_graphs_read_an_fp8_cache(tiny_llama_dir, fp8_cache_transformers):
    """The kernel path's decode steps (through the graphs' padded buffers) over an fp8 cache."""
    prompts = PROMPTS[:3]
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=128, attention_backend="triton",
              device="cuda" if torch.cuda.is_available() else "cpu", kv_cache_dtype="fp8")
    tok = llm.get_tokenizer()
    expected = hf_greedy(tiny_llama_dir, [tok.encode(p) for p in prompts], max_new=6)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_the_rounding_is_visible(tiny_llama_dir):
    """Against plain transformers the fp8 cache's logits differ: the oracle's rounding matters."""
    from transformers import AutoModelForCausalLM

    from worker.core.scheduler import ScheduledRequest, SchedulerOutput

    ids = list(range(5, 60))
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, kv_cache_dtype="fp8")
    logits = llm.engine.runner.execute(SchedulerOutput([ScheduledRequest("a", ids, 0, [0, 1, 2, 3], True)])).logits[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        assert (logits - hf(torch.tensor([ids])).logits[0, -1]).abs().max() > 1e-3


def test_an_fp8_cache_holds_twice_the_tokens(tiny_llama_dir):
    blocks = {dtype: LLM(str(tiny_llama_dir), dtype="bfloat16", kv_cache_memory_gb=0.01,
                         kv_cache_dtype=dtype).engine.runner.num_blocks for dtype in ("auto", "fp8_e4m3")}
    assert blocks["fp8_e4m3"] == 2 * blocks["auto"]


def test_a_bad_kv_cache_dtype_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, fp8 or fp8_e4m3, got 'fp8_e5m2'"):
        LLM(str(tiny_llama_dir), kv_cache_dtype="fp8_e5m2")
