"""The GPU model-runner path (Triton attention and KV-cache kernels, token-major cache) gives
the same greedy tokens as transformers. Without a GPU it runs under TRITON_INTERPRET, set by
tests/conftest.py, with a tiny model and few tokens."""

from __future__ import annotations

import torch
from test_engine import hf_greedy

from producer.sampling_params import SamplingParams
from worker import LLM

PROMPTS = ["Hello, my name is", "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 2, "x"]


def test_triton_backend_matches_transformers(tiny_llama_dir):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(str(tiny_llama_dir), dtype="float32", device=device, attention_backend="triton",
              num_gpu_blocks_override=64, max_num_batched_tokens=24)  # chunked prefill with a prefix
    assert llm.engine.runner.kv_caches[0][0].shape[1:] == (16, 2, 16)  # token-major blocks
    tok = llm.get_tokenizer()
    expected = hf_greedy(tiny_llama_dir, [tok.encode(p) for p in PROMPTS], max_new=8)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
