"""KV offloading (vLLM's kv_offloading_size): cached blocks evicted from a small pool are kept
in host memory and copied back when a prompt's prefix reaches them, so the prefix cache holds
what the host does; outputs stay transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch
from test_engine import greedy, hf_greedy_along

from worker import LLM

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # the tiny Llama's block: 2 layers, K and V, 16 tokens, 2 heads of 16, float32


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_a_prefix_evicted_to_the_host_comes_back(tiny_llama_dir, tensor_parallel_size):
    """A 100-token prompt caches 6 full blocks of a 12-block pool; a 150-token one takes 10,
    evicting 4 of them (tails first) to the host; the first prompt again reads 2 blocks from
    the pool and 4 copied back, and decodes as before. Split over two ranks, each copies its
    own heads' share of every block."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=12, max_model_len=192,
              kv_offloading_size=64 * BLOCK_BYTES / 2**30, tensor_parallel_size=tensor_parallel_size,
              num_threads=1 if tensor_parallel_size > 1 else None)
    assert llm.engine.runner.num_host_blocks == 64
    torch.manual_seed(0)
    first, other = torch.randint(3, 49152, (100,)).tolist(), torch.randint(3, 49152, (150,)).tolist()
    runs = [llm.generate({"prompt_token_ids": ids}, greedy(4), use_tqdm=False)[0] for ids in (first, other, first)]
    assert runs[2].num_cached_tokens == 96  # 2 blocks from the pool, 4 from the host
    assert llm.engine.block_manager.stats.host_hits == 64
    tokens = [run.outputs[0].token_ids for run in runs]
    assert tokens[2] == tokens[0] == hf_greedy_along(tiny_llama_dir, [first], [tokens[0]])[0]


def test_without_room_or_prefix_caching_offloading_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="kv_offloading_size must be > 0 GiB"):
        LLM(str(tiny_llama_dir), kv_offloading_size=0)
    with pytest.raises(ValueError, match=r"holds no block of this model's KV cache \(8192 bytes a block\)"):
        LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=12, max_model_len=192, kv_offloading_size=1e-9)
    with pytest.raises(ValueError, match="KV offloading to host memory .* needs enable_prefix_caching"):
        LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=12, max_model_len=192, kv_offloading_size=0.001,
            enable_prefix_caching=False)


def test_a_draft_model_keeps_no_host_tier(tiny_llama_dir):
    """The target's prefix cache has the host tier; a draft's blocks are its own, uncached."""
    spec = {"model": str(tiny_llama_dir), "num_speculative_tokens": 2}
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=12, max_model_len=192,
              kv_offloading_size=64 * BLOCK_BYTES / 2**30, speculative_config=spec)
    assert llm.engine.runner.num_host_blocks == 64 and llm.engine.speculator.proposer.runner.host_pool is None
