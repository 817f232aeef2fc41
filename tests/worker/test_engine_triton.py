"""The GPU model-runner path (Triton attention and KV-cache kernels, token-major cache) gives
the same greedy tokens as transformers. Without a GPU it runs under TRITON_INTERPRET, set by
tests/conftest.py, with a tiny model and few tokens."""

from __future__ import annotations

import pytest
import torch
from test_engine import hf_greedy, hf_greedy_along
from transformers import AutoModelForCausalLM

from producer.sampling_params import SamplingParams
from worker import LLM
from worker.core.scheduler import ScheduledRequest, SchedulerOutput
from worker.model_executor.cuda_graphs import capture_sizes

PROMPTS = ["Hello, my name is", "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 2, "x"]


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_triton_backend_matches_transformers(tiny_llama_dir, enforce_eager):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device=DEVICE, attention_backend="triton",
              num_gpu_blocks_override=64, max_num_batched_tokens=24,  # chunked prefill with a prefix
              enforce_eager=enforce_eager)
    assert (llm.engine.runner.graphs is None) == enforce_eager
    assert llm.engine.runner.kv_caches[0][0].shape[1:] == (16, 2, 16)  # token-major blocks
    tok = llm.get_tokenizer()
    expected = hf_greedy(tiny_llama_dir, [tok.encode(p) for p in PROMPTS], max_new=8)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("tiny_moe_dir", ["gpt_oss"], indirect=True)
def test_triton_backend_gpt_oss_decodes_like_transformers(tiny_moe_dir):
    """gpt-oss in the decode graphs: attention sinks, biased experts with their clamped unit,
    and decodes past the 24-position window of every other layer."""
    llm = LLM(str(tiny_moe_dir), dtype="float32", device=DEVICE, attention_backend="triton",
              num_gpu_blocks_override=64)
    assert llm.engine.runner.graphs is not None
    tok = llm.get_tokenizer()
    expected = hf_greedy(tiny_moe_dir, [tok.encode(p) for p in PROMPTS], max_new=8)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_decode_graphs_pad_shrinking_batches(tiny_llama_dir):
    """Sequences finish one after another, so decode batches of 6, 5, ... 1 run padded to the
    captured sizes 8, 4, 2 and 1; a context crosses a block boundary on the way (the third's,
    11 prompt tokens and 7 more). Greedy tokens must still be transformers'."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", device=DEVICE, attention_backend="triton",
              num_gpu_blocks_override=64, max_num_seqs=6)
    graphs = llm.engine.runner.graphs
    assert graphs.sizes == [1, 2, 4, 8]
    tok = llm.get_tokenizer()
    prompts = ["x", "Hello, my name is", "one two three four five six seven eight nine ten eleven",
               "a b c", "The quick brown fox", "1, 2, 3,"]
    max_tokens = [2, 10, 7, 6, 3, 8]
    expected = hf_greedy(tiny_llama_dir, [tok.encode(p) for p in prompts], max_new=max(max_tokens))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [e[:n] for e, n in zip(expected, max_tokens, strict=True)]
    assert all(graphs.num_steps[n] > 0 for n in (1, 2, 4, 8)), graphs.num_steps


def test_capture_sizes_cover_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(9) == [1, 2, 4, 8, 16]
    assert capture_sizes(128) == [1, 2, 4, *range(8, 129, 8)]
    assert capture_sizes(100_000)[-1] == 512  # larger decode batches run eagerly


def _bf16_last_logits(model_dir, backend: str, prompts: list[list[int]]) -> torch.Tensor:
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    llm = LLM(str(model_dir), dtype="bfloat16", device=device, attention_backend=backend,
              num_gpu_blocks_override=64)
    batch = [ScheduledRequest(str(i), ids, 0, [3 * i, 3 * i + 1, 3 * i + 2], True) for i, ids in enumerate(prompts)]
    return llm.engine.runner.execute(SchedulerOutput(batch)).logits.cpu()  # [B, vocab] float32


def test_triton_backend_bf16_error_matches_torch_backend(tiny_llama_dir):
    """bfloat16 rounds differently in the kernels (rotary once per pair, attention in fp32
    tiles) than in torch ops; measured against float32 transformers, the triton path's error
    must be of the same size as the torch path's (RMS over the logits: the max of a few
    thousand rounding errors is too noisy to compare), and both small against the logits."""
    torch.manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,)).tolist() for n in (5, 23, 17, 40)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = torch.stack([hf(torch.tensor([ids])).logits[0, -1] for ids in prompts])  # [B, vocab]

    def rms(x: torch.Tensor) -> float:
        return float(x.pow(2).mean().sqrt())

    torch_err = rms(_bf16_last_logits(tiny_llama_dir, "torch", prompts) - ref)
    triton_err = rms(_bf16_last_logits(tiny_llama_dir, "triton", prompts) - ref)
    assert torch_err < 0.05 * rms(ref)
    assert triton_err < 1.5 * torch_err, (triton_err, torch_err)


def test_triton_backend_samples_the_torch_backends_tokens(tiny_llama_dir):
    """Seeded top-k / top-p sampling: the kernel path (attention, norms, rotary and the sampling
    kernel) draws the same tokens as the torch path from the same seeds."""
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=11, max_tokens=2, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.7, seed=12, max_tokens=2, ignore_eos=True)]
    prompts = [PROMPTS[0], PROMPTS[0]]  # one prompt under each setting (the interpreter is slow)

    def tokens(backend: str) -> list[list[int]]:
        device = DEVICE if backend == "triton" else "cpu"
        llm = LLM(str(tiny_llama_dir), dtype="float32", device=device, attention_backend=backend,
                  num_gpu_blocks_override=64)
        assert llm.engine.sampler.use_kernel == (backend == "triton")
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    assert tokens("triton") == tokens("torch")


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_decode_graphs_carry_the_requests_states(tiny_family, family):
    """Decode batches of a model with states (Qwen3.5's Gated DeltaNet, Nemotron-H's Mamba2 with
    its convolution's bias), in the decode-step kernels, through the graphs' padded buffers:
    each row's state slot from a static buffer, the padding rows' a slot of their own, the
    states saved every 16 tokens copied after; the prompts' own steps (and a request's first
    after a prefix hit) run eagerly. Greedy tokens equal transformers', and the follow-ups',
    served from a decode's saved state."""
    model = tiny_family(family)
    llm = LLM(str(model), dtype="float32", device=DEVICE, attention_backend="triton", num_gpu_blocks_override=64,
              max_num_seqs=3, max_model_len=128, mamba_block_size=16, num_state_snapshots=8)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4]
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in ("Hello, my name is", "The quick brown fox", "1, 2, 3,")]
    max_tokens = [12, 20, 6]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert tokens == hf_greedy_along(model, prompts, tokens)
    assert all(graphs.num_steps[n] > 0 for n in (1, 2, 4)), graphs.num_steps
    follow_ups = [prompts[1] + tokens[1] + tok.encode(" and"), (prompts[1] + tokens[1])[:17]]  # the second: one
    # token past the saved state, a first step of one row that must restore it (eagerly)
    for ids in follow_ups:
        [out] = llm.generate({"prompt_token_ids": ids}, params[0], use_tqdm=False)
        assert out.num_cached_tokens == 16
        assert out.outputs[0].token_ids == hf_greedy_along(model, [ids], [out.outputs[0].token_ids])[0]
