"""Images in Gemma 3 prompts, on a tiny Gemma 3: greedy tokens and their logprobs against
transformers' Gemma3ForConditionalGeneration given the same pixels. Gemma 3's image tokens
attend to each other both ways (the rest causally, a window bounding what lies before):
these check that mask on both attention paths, and the scheduler keeping each image in one
chunk however small the chunks. transformers' Gemma 3 processor is written out below: its
image processor on PIL makes the pixels, and each <start_of_image> becomes a blank line,
itself, the image tokens, <end_of_image> and a blank line, in the text, before tokenizing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_images import CHAT_TEXT, _generate, chat_about, picture

from worker import LLM, SamplingParams

BOI, IMAGE_TOKEN, EOI = "<issue_start>", "<issue_closed>", "<issue_comment>"  # ids 8, 10, 9
NUM_TOKENS = 16  # mm_tokens_per_image


def hf_greedy_logprobs(model_dir: Path, text: str, images: list, max_new: int = 10) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens for a prompt whose <start_of_image> tokens stand for
    `images`, and each one's logprob."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    pixels = AutoImageProcessor.from_pretrained(model_dir, backend="pil")(images=images, return_tensors="pt")
    expanded = text.replace(BOI, f"\n\n{BOI}{IMAGE_TOKEN * NUM_TOKENS}{EOI}\n\n")  # Gemma3Processor's
    ids = AutoTokenizer.from_pretrained(model_dir).encode(expanded)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), pixel_values=pixels["pixel_values"],
                             token_type_ids=torch.tensor([[int(i == 10) for i in ids]]),
                             max_new_tokens=max_new, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [float(row[0].log_softmax(-1)[t]) for row, t in zip(out.logits, tokens, strict=True)]


PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
ONE = (f"Describe\n{BOI} in a word:", [picture(40, 56, 0)])
TWO = (f"Compare {BOI} with {BOI}, please.", [picture(64, 32, 1), picture(20, 64, 2)])


def _check(llm: LLM, cases, model_dir: Path) -> list:
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}} for text, images in cases],
                           PARAMS, use_tqdm=False)
    for out, case in zip(outputs, cases, strict=True):
        tokens, logprobs = hf_greedy_logprobs(model_dir, *case)
        assert out.outputs[0].token_ids == tokens
        assert [entry.logprob for entry in out.outputs[0].logprobs] == pytest.approx(logprobs, abs=1e-4)
    return outputs


def test_greedy_matches_transformers_with_images(tiny_gemma3_images_dir):
    llm = LLM(str(tiny_gemma3_images_dir), dtype="float32", num_gpu_blocks_override=64)
    outputs = _check(llm, [ONE, TWO], tiny_gemma3_images_dir)
    assert outputs[1].prompt_token_ids.count(10) == 2 * NUM_TOKENS


def test_small_chunks_keep_each_image_whole(tiny_gemma3_images_dir):
    """Chunks of 20 tokens: a chunk that would end inside an image ends before it, and the
    image is computed whole in the next step (so its tokens see each other)."""
    llm = LLM(str(tiny_gemma3_images_dir), dtype="float32", num_gpu_blocks_override=64,
              max_num_batched_tokens=20, max_num_seqs=2)
    _check(llm, [TWO, ONE], tiny_gemma3_images_dir)


def test_the_triton_path_lets_image_tokens_see_their_whole_image(tiny_gemma3_images_dir):
    llm = LLM(str(tiny_gemma3_images_dir), dtype="float32", num_gpu_blocks_override=64, attention_backend="triton",
              device="cuda" if torch.cuda.is_available() else "cpu", max_num_batched_tokens=20, max_num_seqs=2)
    _check(llm, [ONE, TWO], tiny_gemma3_images_dir)


def test_the_prefix_cache_resumes_inside_an_image(tiny_gemma3_images_dir):
    """A cached prefix that ends inside an image (computed whole the first time): the rest
    of the image is computed seeing the cached part. The prompt fills one block of 16 and
    part of the next, the image across both."""
    llm = LLM(str(tiny_gemma3_images_dir), dtype="float32", num_gpu_blocks_override=64, block_size=16,
              max_model_len=256)
    case = (f"A few words first: {BOI} ok", [picture(48, 48, 5)])
    first = _check(llm, [case], tiny_gemma3_images_dir)[0]
    again = _check(llm, [case], tiny_gemma3_images_dir)[0]
    start = first.prompt_token_ids.index(10)
    assert len(first.prompt_token_ids) < 32
    assert start < again.num_cached_tokens == 16 < start + NUM_TOKENS


def test_chat_messages_carry_images(tiny_gemma3_images_dir):
    image = picture(48, 48, 6)
    out = chat_about(LLM(str(tiny_gemma3_images_dir), dtype="float32", num_gpu_blocks_override=64), image, PARAMS)
    tokens, logprobs = hf_greedy_logprobs(tiny_gemma3_images_dir, CHAT_TEXT.format(BOI), [image])
    assert out.outputs[0].token_ids == tokens
    assert [entry.logprob for entry in out.outputs[0].logprobs] == pytest.approx(logprobs, abs=1e-4)


def test_token_ids_given_are_taken_as_they_are(tiny_gemma3_images_dir):
    """Only a text prompt gets the blank lines: a caller's token ids have each
    <start_of_image> widened in place."""
    llm = LLM(str(tiny_gemma3_images_dir), dtype="float32", num_gpu_blocks_override=64)
    ids = llm.get_tokenizer().encode(ONE[0])
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": ONE[1]}}, PARAMS, use_tqdm=False)[0]
    k = ids.index(8)
    assert out.prompt_token_ids == ids[:k] + [8] + [10] * NUM_TOKENS + [9] + ids[k + 1:]


def test_pan_and_scan_is_refused_by_name(tiny_gemma3_images_dir):
    with pytest.raises(ValueError, match="pan and scan .do_pan_and_scan. is not supported"):
        LLM(str(tiny_gemma3_images_dir), dtype="float32", num_gpu_blocks_override=64,
            mm_processor_kwargs={"do_pan_and_scan": True})


def test_an_image_longer_than_a_step_is_refused(tiny_gemma3_images_dir):
    llm = LLM(str(tiny_gemma3_images_dir), dtype="float32", num_gpu_blocks_override=64, max_num_batched_tokens=8,
              max_num_seqs=2)
    with pytest.raises(ValueError, match="an image takes 16 tokens, computed in one step, but max_num_batched_tokens is 8"):
        _generate(llm, [ONE])
