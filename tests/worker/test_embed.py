"""Embeddings (`LLM.embed`, vLLM's pooling of decoder models): the final hidden state of the
prompt's last token, after the model's last norm, L2-normalized. The oracle is transformers'
`last_hidden_state` for the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from producer.pooling_params import PoolingParams
from producer.sampling_params import SamplingParams

PROMPTS = ["Hello", "The capital of France is Paris, and the capital of Italy is",
           "A much longer prompt, long enough to be computed over several chunks of prefill " * 3]


@pytest.fixture(scope="module")
def hf_hidden(tiny_llama_dir: Path):
    """`hf_hidden(token_ids)`: transformers' last hidden state of the last token (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def hidden(token_ids: list[int]) -> torch.Tensor:
        return model.model(torch.tensor([token_ids])).last_hidden_state[0, -1]

    return hidden


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path):
    from worker import LLM

    # a small token budget: the long prompt's prefill takes several steps
    return LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, max_num_batched_tokens=32,
               max_num_seqs=8)


def test_embeddings_are_the_normalized_last_hidden_state(llm, hf_hidden) -> None:
    outs = llm.embed(PROMPTS, use_tqdm=False)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = llm.get_tokenizer().encode(prompt)
        assert out.prompt_token_ids == ids
        vector = torch.tensor(out.outputs.embedding)
        expected = torch.nn.functional.normalize(hf_hidden(ids), dim=-1)
        torch.testing.assert_close(vector, expected, atol=1e-5, rtol=1e-4)
        assert vector.norm().item() == pytest.approx(1.0, abs=1e-5)
    raw = llm.embed({"prompt_token_ids": [1, 450, 7483]}, PoolingParams(normalize=False), use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding), hf_hidden([1, 450, 7483]), atol=1e-5, rtol=1e-4)


def test_matryoshka_dimensions_cut_the_vector_where_the_model_declares_them(tiny_llama_dir: Path, hf_hidden,
                                                                             llm) -> None:
    """`dimensions`: the first values of the hidden state, normalized, for a model whose config
    declares Matryoshka embeddings (here by vLLM's hf_overrides); refused for one that does not,
    or at a size it does not list."""
    from worker import LLM

    ids = [1, 450, 7483, 29871]
    matryoshka = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64,
                     hf_overrides={"is_matryoshka": True})
    out = matryoshka.embed({"prompt_token_ids": ids}, PoolingParams(dimensions=16), use_tqdm=False)[0]
    expected = torch.nn.functional.normalize(hf_hidden(ids)[:16], dim=-1)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=1e-5, rtol=1e-4)
    listed = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64,
                 hf_overrides={"matryoshka_dimensions": [16, 32]})
    assert len(listed.embed({"prompt_token_ids": ids}, PoolingParams(dimensions=32), use_tqdm=False)[0]
               .outputs.embedding) == 32
    with pytest.raises(ValueError, match=r"dimensions must be one of this model's Matryoshka sizes \(\[16, 32\]\)"):
        listed.embed({"prompt_token_ids": ids}, PoolingParams(dimensions=24), use_tqdm=False)
    with pytest.raises(ValueError, match="does not declare Matryoshka embeddings"):
        llm.embed({"prompt_token_ids": ids}, PoolingParams(dimensions=16), use_tqdm=False)


def test_embeddings_share_steps_with_generation_and_the_prefix_cache(llm, hf_hidden) -> None:
    """Embedding requests ride in the same batches as generating ones, leave no blocks held,
    and a prompt served from the prefix cache pools the same vector."""
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    expected_text = llm.generate(PROMPTS[1], greedy, use_tqdm=False)[0].outputs[0].text
    engine.add_request("gen", PROMPTS[1], greedy)
    engine.add_request("emb", PROMPTS[1], pooling_params=PoolingParams())
    engine.add_request("emb-long", PROMPTS[2], pooling_params=PoolingParams())
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["gen"].embedding is None and finals["emb"].outputs[0].token_ids == []
    assert finals["emb"].outputs[0].finish_reason == "stop"
    for rid, prompt in (("emb", PROMPTS[1]), ("emb-long", PROMPTS[2])):
        ids = llm.get_tokenizer().encode(prompt)
        expected = torch.nn.functional.normalize(hf_hidden(ids), dim=-1)
        torch.testing.assert_close(torch.tensor(finals[rid].embedding), expected, atol=1e-5, rtol=1e-4)
    engine.add_request("emb-again", PROMPTS[2], pooling_params=PoolingParams())  # its full blocks are cached now
    again = [o for _ in range(50) if engine.has_unfinished_requests() for o in engine.step() if o.finished][0]
    assert again.num_cached_tokens > 0
    torch.testing.assert_close(torch.tensor(again.embedding), torch.tensor(finals["emb-long"].embedding),
                               atol=1e-5, rtol=1e-4)
    generated = llm.generate(PROMPTS[1], greedy, use_tqdm=False)[0].outputs[0].text
    assert generated == expected_text
    assert engine.block_manager.num_free_blocks == free


def test_long_prompts_fill_the_context_or_are_truncated_when_asked(tiny_llama_dir: Path, hf_hidden) -> None:
    """An embedding's prompt may be max_model_len long (nothing is generated after it);
    truncate_prompt_tokens keeps the last k tokens of a longer one, as vLLM's does."""
    from worker import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64, max_model_len=64)
    ids = list(range(5, 5 + 80))
    full = llm.embed({"prompt_token_ids": ids[:64]}, use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(full.outputs.embedding),
                               torch.nn.functional.normalize(hf_hidden(ids[:64]), dim=-1), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="the prompt has 80 tokens, but max_model_len is 64 .truncate_prompt_tokens"):
        llm.embed({"prompt_token_ids": ids}, use_tqdm=False)
    for k, kept in ((10, ids[-10:]), (-1, ids[-64:])):
        out = llm.embed({"prompt_token_ids": ids}, PoolingParams(truncate_prompt_tokens=k), use_tqdm=False)[0]
        assert out.prompt_token_ids == kept
        torch.testing.assert_close(torch.tensor(out.outputs.embedding),
                                   torch.nn.functional.normalize(hf_hidden(kept), dim=-1), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="at least one token must be left to generate"):
        llm.generate({"prompt_token_ids": ids[:64]}, use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be a positive number of tokens or -1"):
        PoolingParams(truncate_prompt_tokens=0)


def test_bad_embedding_requests_are_refused(llm) -> None:
    with pytest.raises(ValueError, match="one output, got n=2"):
        llm.engine.add_request("x", "hi", SamplingParams(n=2), pooling_params=PoolingParams())
    with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):
        llm.embed(["fine", ""], use_tqdm=False)
    with pytest.raises(ValueError, match="normalize must be true or false"):
        PoolingParams(normalize="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown pooling parameter"):
        PoolingParams.from_dict({"width": 8})
    with pytest.raises(ValueError, match="dimensions must be a positive number, got 0"):
        PoolingParams(dimensions=0)


@pytest.fixture(scope="module")
def embedding_model_dir(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """A tiny model saved as a base model (`LlamaModel`, `Gemma2Model`: no LM head, no
    `model.` prefix), the layout of decoder embedding checkpoints."""
    import shutil

    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("embedding-model")
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model_dir / name).exists():
            shutil.copy(tiny_model_dir / name, out / name)
    return out


# e5-mistral and gte-Qwen2 are Llama-family base models; bge-multilingual-gemma2 a Gemma 2 one
@pytest.mark.parametrize("tiny_model_dir", ["llama", "gemma2"], indirect=True)
def test_an_embedding_model_without_lm_head_serves_embeddings_only(embedding_model_dir: Path) -> None:
    import json

    from safetensors import safe_open
    from transformers import AutoModel

    from worker import LLM

    arch = json.loads((embedding_model_dir / "config.json").read_text())["architectures"][0]
    assert arch in ("LlamaModel", "Gemma2Model")
    with safe_open(str(embedding_model_dir / "model.safetensors"), "pt") as f:
        assert "norm.weight" in f.keys() and not any(k.startswith(("model.", "lm_head")) for k in f.keys())
    llm = LLM(str(embedding_model_dir), dtype="float32", num_gpu_blocks_override=64)
    ids = llm.get_tokenizer().encode("An embedding model")
    vector = torch.tensor(llm.embed("An embedding model", use_tqdm=False)[0].outputs.embedding)
    hf = AutoModel.from_pretrained(embedding_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.nn.functional.normalize(hf(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)
    torch.testing.assert_close(vector, expected, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match=rf"\({arch}\) has no LM head: it serves embedding requests only"):
        llm.generate("Generate?", SamplingParams(max_tokens=2), use_tqdm=False)


def test_a_classification_model_gives_label_probabilities(tiny_classifier_dir: Path) -> None:
    """A decoder with a score head (LlamaForSequenceClassification): `LLM.classify` gives the
    softmax of transformers' logits for each prompt's last token, labels from its config."""
    from transformers import AutoModelForSequenceClassification

    from worker import LLM

    llm = LLM(str(tiny_classifier_dir), dtype="float32", num_gpu_blocks_override=64)
    assert llm.label_names == ("negative", "neutral", "positive")
    prompts = ["I loved it", "The weather report, read twice over: rain, then sun, then rain again."]
    outs = llm.classify(prompts, use_tqdm=False)
    hf = AutoModelForSequenceClassification.from_pretrained(tiny_classifier_dir, dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            expected = hf(torch.tensor([tok.encode(prompt)])).logits[0].softmax(-1)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), expected, atol=1e-5, rtol=1e-4)
    assert len({tuple(round(p, 3) for p in o.outputs.probs) for o in outs}) == 2  # the prompts differ
    with pytest.raises(ValueError, match="has no LM head"):
        llm.generate("Generate?", SamplingParams(max_tokens=2), use_tqdm=False)
