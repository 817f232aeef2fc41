"""Prompts given as embeddings (vLLM's `{"prompt_embeds": tensor}`) against transformers'
`generate(inputs_embeds=...)`: the same greedy tokens, in families whose embedding is scaled
inside it (Gemma) or after it (Granite: inputs_embeds scaled too), with linear attention
(Qwen3.5), over chunked prefills, with penalties that see no prompt tokens, and the prefix
cache keyed by the embeddings."""

from __future__ import annotations

import io

import pytest
import torch
from transformers import AutoModelForCausalLM

from producer.sampling_params import SamplingParams
from worker import LLM

PROMPT_IDS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [40, 41, 42, 43, 44]]


def embeddings(model, ids: list[int], seed: int = 0) -> torch.Tensor:
    """The model's input embeddings of `ids`, moved off them a little (nothing a token has)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(torch.tensor(ids))
    return embeds + 0.1 * embeds.std() * torch.randn(embeds.shape, generator=generator)


def hf_greedy(model, embeds: torch.Tensor, max_tokens: int, **kwargs) -> list[int]:
    with torch.no_grad():
        out = model.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, len(embeds), dtype=torch.long),
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, **kwargs)
    return out[0].tolist()


@pytest.mark.parametrize("family", ["llama", "gemma2", "granite", "qwen3_5"])
def test_prompt_embeds_decode_as_transformers_inputs_embeds(family, tiny_family):
    model_dir = tiny_family(family)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    embeds = [embeddings(hf, ids, seed) for seed, ids in enumerate(PROMPT_IDS)]
    llm = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_embeds": e} for e in embeds], params, use_tqdm=False)
    for out, e in zip(outs, embeds, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, e, 8)
        assert out.prompt_token_ids == [] and out.num_prompt_tokens == len(e) and out.prompt is None


def test_penalties_truncation_bytes_and_the_prefix_cache(tiny_llama_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    embeds = embeddings(hf, PROMPT_IDS[0] * 2)  # 40 positions: two whole blocks and more
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    # a repetition penalty sees the generated tokens only: the prompt has none (as transformers'
    # inputs_embeds-only generate)
    penalized = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8)
    out = llm.generate({"prompt_embeds": embeds}, penalized, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, embeds, 12, repetition_penalty=1.8)
    # the placeholder ids are no tokens: a repetition "penalty" that rewards the tokens seen
    # (prompt and output, as vLLM's) does not lift token 0 (the placeholders' id), biased to
    # just under the first pick
    with torch.no_grad():
        logits = hf(inputs_embeds=embeds[None]).logits[0, -1]
    first, bias = int(logits.argmax()), float(logits.max() - logits[0] - 0.5)
    rewarded = SamplingParams(temperature=0.0, max_tokens=1, repetition_penalty=0.1, logit_bias={0: bias})
    assert llm.generate({"prompt_embeds": embeds}, rewarded, use_tqdm=False)[0].outputs[0].token_ids == [first]
    ids = llm.generate({"prompt_token_ids": [0] * len(embeds)}, rewarded, use_tqdm=False)[0]  # what seeing 0 does
    assert ids.outputs[0].token_ids == [0]
    # torch.save's bytes, as they come through the queue; the same embeddings hit the cache
    buffer = io.BytesIO()
    torch.save(embeds, buffer)
    again = llm.generate({"prompt_embeds": buffer.getvalue()}, penalized, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids and again.num_cached_tokens == 32
    # others of the same length (the same placeholder ids) do not
    other = embeddings(hf, PROMPT_IDS[0] * 2, seed=5)
    fresh = llm.generate({"prompt_embeds": other}, penalized, use_tqdm=False)[0]
    assert fresh.num_cached_tokens == 0 and fresh.outputs[0].token_ids == hf_greedy(hf, other, 12, repetition_penalty=1.8)
    # truncate_prompt_tokens keeps the last rows; n > 1 samples share them
    cut = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=7, n=2)
    both = llm.generate({"prompt_embeds": embeds}, cut, use_tqdm=False)[0]
    assert [c.token_ids for c in both.outputs] == [hf_greedy(hf, embeds[-7:], 6)] * 2
    assert both.num_prompt_tokens == 7


def test_bad_prompt_embeds_are_refused_by_name(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    cases = [
        ({"prompt_embeds": torch.zeros(5, 32)}, r"prompt_embeds must be \[positions, 64\] .* got \[5, 32\]"),
        ({"prompt_embeds": torch.zeros(5, 64, dtype=torch.long)}, "must be floating point, got torch.int64"),
        ({"prompt_embeds": torch.full((5, 64), float("nan"))}, "not finite"),
        ({"prompt_embeds": torch.zeros(0, 64)}, r"got \[0, 64\]"),
        ({"prompt_embeds": b"not a tensor"}, "is not a tensor saved with torch.save"),
        ({"prompt_embeds": torch.zeros(5, 64), "prompt": "hi"}, "takes nothing else, got prompt"),
        ({"prompt_embeds": torch.zeros(2000, 64)}, "the prompt has 2000 tokens, but max_model_len is 1024"),
    ]
    for prompt, error in cases:
        with pytest.raises(ValueError, match=error):
            llm.engine.add_request("r", prompt, SamplingParams())
    with pytest.raises(ValueError, match="prompt_logprobs needs the prompt's tokens"):
        llm.engine.add_request("r", {"prompt_embeds": torch.zeros(5, 64)}, SamplingParams(prompt_logprobs=1))
    with pytest.raises(ValueError, match="beam search over prompts with images or prompt_embeds"):
        from worker import BeamSearchParams

        llm.beam_search([{"prompt_embeds": torch.zeros(5, 64)}], BeamSearchParams(beam_width=2, max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


def test_prompt_embeds_reach_every_tensor_parallel_rank(tiny_llama_dir):
    """Rank 0 holds the embeddings and sends each step's rows with it, as it sends images'."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    embeds = embeddings(hf, PROMPT_IDS[0])
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, tensor_parallel_size=2,
              max_num_batched_tokens=8)
    out = llm.generate({"prompt_embeds": embeds}, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, embeds, 8)
