"""Beam search (`use_beam_search`, vLLM's extra) through a live stack: the n best beams of an
n-wide search, each step run as one-token jobs. The oracle is transformers' beam search on
the same tokens, with the end of sequence off on both sides (ignore_eos), so every beam runs
to max_tokens and the ranking is by total log-probability on both sides."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch


@pytest.fixture(scope="module")
def hf_beams(tiny_llama_dir: Path):
    """`hf_beams(prompt_ids, width, max_new)`: transformers' `width` best beams, best first."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None

    @torch.inference_mode()
    def beams(prompt_ids: list[int], width: int, max_new: int) -> list[list[int]]:
        out = model.generate(torch.tensor([prompt_ids]), num_beams=width, num_return_sequences=width,
                             do_sample=False, max_new_tokens=max_new, pad_token_id=0, length_penalty=1.0)
        return [row[len(prompt_ids):].tolist() for row in out]

    return beams


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_completion_beams_match_transformers(served_model: str, oai: openai.OpenAI, hf_beams, tokenizer) -> None:
    prompt = "The old lighthouse keeper"
    reply = oai.completions.create(model=served_model, prompt=prompt, n=3, max_tokens=6, temperature=0.0,
                                   extra_body={"use_beam_search": True, "ignore_eos": True})
    expected = hf_beams(tokenizer.encode(prompt), 3, 6)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == [tokenizer.decode(ids, skip_special_tokens=True) for ids in expected]
    assert all(c.finish_reason == "length" for c in reply.choices)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(tokenizer.encode(prompt)), 18)
    greedy = oai.completions.create(model=served_model, prompt=prompt, max_tokens=6, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    one = oai.completions.create(model=served_model, prompt=prompt, max_tokens=6, temperature=0.0,
                                 extra_body={"use_beam_search": True, "ignore_eos": True})
    assert one.choices[0].text == greedy.choices[0].text  # a beam of one is greedy


def test_chat_beams_match_transformers(served_model: str, oai: openai.OpenAI, hf_beams, tokenizer) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    reply = oai.chat.completions.create(model=served_model, messages=messages, n=2, max_tokens=5,
                                        extra_body={"use_beam_search": True, "ignore_eos": True})
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = hf_beams(list(prompt_ids), 2, 5)
    assert [c.message.content for c in reply.choices] == [tokenizer.decode(ids, skip_special_tokens=True)
                                                           for ids in expected]


def test_beam_search_refuses_what_it_cannot_do(served_model: str, http: httpx.Client) -> None:
    body = {"model": served_model, "prompt": "x", "use_beam_search": True}
    for extra, param in (({"stream": True}, "use_beam_search"), ({"n": 11}, "n"),
                         ({"guided_choice": ["a", "b"]}, "guided_choice")):
        response = http.post("/v1/completions", json={**body, **extra})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
