"""Images in prompts, on a tiny Mistral 3 (Pixtral's vision tower, Mistral 3's projector): greedy
tokens against transformers' Mistral3ForConditionalGeneration given the same pixels, whole
and chunked, with the prefix cache telling images apart. transformers' Pixtral processor
needs torchvision, absent here: its image processor on PIL makes the pixels, and its
placeholder expansion (`PixtralProcessor.replace_image_token`) is written out below."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from worker import LLM, SamplingParams


def picture(height: int, width: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (height, width, 3), dtype=np.uint8))


def hf_greedy(model_dir: Path, text: str, images: list[Image.Image], max_new: int = 12) -> list[int]:
    """transformers' greedy tokens for a prompt whose placeholders stand for `images`."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    processor = json.loads((model_dir / "processor_config.json").read_text())
    patch = processor["patch_size"] * processor["spatial_merge_size"]
    features = AutoImageProcessor.from_pretrained(model_dir, backend="pil")(
        images=images, patch_size=patch, return_tensors="pt")
    pieces = text.split(processor["image_token"])
    expanded = pieces[0]
    for (height, width), rest in zip(features["image_sizes"].tolist(), pieces[1:], strict=True):
        # PixtralProcessor.replace_image_token: a row of image tokens and a break per row of
        # merged patches, the last break an end
        rows = ((processor["image_token"] * (width // patch) + processor["image_break_token"]) * (height // patch))
        expanded += rows.removesuffix(processor["image_break_token"]) + processor["image_end_token"] + rest
    ids = AutoTokenizer.from_pretrained(model_dir).encode(expanded)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), pixel_values=features["pixel_values"],
                             image_sizes=features["image_sizes"], max_new_tokens=max_new, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _bomb() -> bytes:
    """The start of a PNG that says it is 20000 x 20000 pixels (1.2 GB decoded)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)) + chunk(b"IDAT", b"")


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ONE = ("Describe <issue_closed> in a word:", [picture(40, 56, 0)])
TWO = ("Compare <issue_closed> with <issue_closed>, please.", [picture(64, 48, 1), picture(20, 64, 2)])


# the text the tiny fixtures' chat templates write for chat_about's message, the image's placeholder in {}
CHAT_TEXT = "<|im_start|>user\nWhat is in {}<|im_end|>\n<|im_start|>assistant\n"


def chat_about(llm: LLM, image: Image.Image, params: SamplingParams):
    """A user message asking about `image` (vLLM's image_pil part), answered."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in "},
                                             {"type": "image_pil", "image_pil": image}]}]
    return llm.chat(messages, params, use_tqdm=False)[0]


def _generate(llm: LLM, cases) -> list:
    return llm.generate([{"prompt": text, "multi_modal_data": {"image": images}} for text, images in cases],
                        GREEDY, use_tqdm=False)


def test_greedy_matches_transformers_with_images(tiny_mistral3_dir):
    llm = LLM(str(tiny_mistral3_dir), dtype="float32", num_gpu_blocks_override=64)
    outputs = _generate(llm, [ONE, TWO])
    for (text, images), out in zip([ONE, TWO], outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(tiny_mistral3_dir, text, images)
    # the second prompt's two images: 4 x 3 merged patches, and 2 x 4 (20 rows of pixels round up
    # to two patches of 16), each row ended by a break (the last by the end)
    assert outputs[1].prompt_token_ids.count(10) == 4 * 3 + 2 * 4
    assert outputs[1].prompt_token_ids.count(8) + outputs[1].prompt_token_ids.count(9) == 4 + 2


def test_a_chunked_prefill_cuts_through_the_images(tiny_mistral3_dir):
    """Chunks of 8 tokens: each image's embeddings are split across steps."""
    llm = LLM(str(tiny_mistral3_dir), dtype="float32", num_gpu_blocks_override=64, max_num_batched_tokens=8,
              max_num_seqs=2)
    outputs = _generate(llm, [TWO])
    assert outputs[0].outputs[0].token_ids == hf_greedy(tiny_mistral3_dir, *TWO)


def test_the_prefix_cache_tells_images_apart(tiny_mistral3_dir):
    """The same text around another image shares only the blocks before the image."""
    llm = LLM(str(tiny_mistral3_dir), dtype="float32", num_gpu_blocks_override=64, block_size=16)
    text = "Some words to fill the first block of sixteen tokens, and more of them. " * 2 + "Now: <issue_closed>."
    first, second = picture(64, 64, 3), picture(64, 64, 4)
    ran = [_generate(llm, [(text, [image])])[0] for image in (first, second, first)]
    embeds = llm.engine.runner.image_embeds
    assert (embeds.num_encoded, embeds.num_reused) == (2, 1)  # the first image again: not encoded again
    start = ran[0].prompt_token_ids.index(10)
    assert ran[1].num_cached_tokens == start // 16 * 16  # up to the block the image begins in
    assert ran[2].num_cached_tokens > start  # the first image again: its blocks are reused
    assert ran[2].outputs[0].token_ids == ran[0].outputs[0].token_ids
    assert [r.outputs[0].token_ids for r in ran[:2]] == [hf_greedy(tiny_mistral3_dir, text, [i]) for i in (first, second)]


def test_an_image_encoded_lately_beside_a_new_one(tiny_mistral3_dir):
    """The cached image's embeddings and the new one's, encoded alone, go back in the prompt's
    order."""
    llm = LLM(str(tiny_mistral3_dir), dtype="float32", num_gpu_blocks_override=64, enable_prefix_caching=False)
    _generate(llm, [TWO])
    mixed = ("First <issue_closed>, then <issue_closed>.", [picture(48, 48, 9), TWO[1][1]])
    out = _generate(llm, [mixed])[0]
    embeds = llm.engine.runner.image_embeds
    assert (embeds.num_encoded, embeds.num_reused) == (3, 1)
    assert out.outputs[0].token_ids == hf_greedy(tiny_mistral3_dir, *mixed)


def test_chat_messages_carry_images(tiny_mistral3_dir):
    import base64
    import io

    image = picture(48, 48, 5)
    encoded = io.BytesIO()
    image.save(encoded, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(encoded.getvalue()).decode()
    llm = LLM(str(tiny_mistral3_dir), dtype="float32", num_gpu_blocks_override=64)
    for part in ({"type": "image_url", "image_url": {"url": url}}, {"type": "image_pil", "image_pil": image}):
        messages = [{"role": "user", "content": [{"type": "text", "text": "What is in "}, part]}]
        out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
        text = "<|im_start|>user\nWhat is in <issue_closed><|im_end|>\n<|im_start|>assistant\n"
        assert out.outputs[0].token_ids == hf_greedy(tiny_mistral3_dir, text, [image])


@pytest.mark.parametrize(("prompt", "error"), [
    ({"prompt": "Two <issue_closed> <issue_closed>", "multi_modal_data": {"image": [picture(8, 8, 0)]}},
     "2 image placeholder.* but 1 image"),
    ({"prompt": "<issue_closed>", "multi_modal_data": {"image": b"not a picture"}}, "image 0 is not an image"),
    ({"prompt": "<issue_closed>", "multi_modal_data": {"audio": b""}}, "of kind 'audio' is not supported"),
    ({"prompt": "<issue_closed>", "multi_modal_data": {"image": _bomb()}}, "image 0 is too large"),
])
def test_bad_images_are_refused_by_name(tiny_mistral3_dir, prompt, error):
    llm = LLM(str(tiny_mistral3_dir), dtype="float32", num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match=error):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_more_images_than_max_images_per_prompt_are_refused(tiny_mistral3_dir):
    llm = LLM(str(tiny_mistral3_dir), dtype="float32", num_gpu_blocks_override=64, max_images_per_prompt=1)
    with pytest.raises(ValueError, match=r"the prompt holds 2 images, more than max_images_per_prompt \(1\)"):
        _generate(llm, [TWO])
    assert _generate(llm, [ONE])[0].outputs[0].token_ids == hf_greedy(tiny_mistral3_dir, *ONE)


def test_a_text_model_takes_no_images(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="takes no images or audio"):
        llm.generate({"prompt": "x", "multi_modal_data": {"image": picture(8, 8, 0)}}, GREEDY, use_tqdm=False)
    chat = [{"role": "user", "content": [{"type": "audio", "audio": b"RIFF"}, {"type": "text", "text": "hi"}]}]
    with pytest.raises(ValueError, match=r"this model \(LlamaForCausalLM\) takes no images or audio"):
        llm.chat(chat, GREEDY, use_tqdm=False)


def test_other_image_text_models_take_no_images(tiny_image_text_dir):
    """Image-text checkpoints without their image processor's config serve text alone: an
    image is refused by name, not dropped."""
    llm = LLM(str(tiny_image_text_dir), dtype="float32", num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="takes no images"):
        llm.generate({"prompt": "x", "multi_modal_data": {"image": picture(8, 8, 0)}}, GREEDY, use_tqdm=False)


def test_dummy_weights_take_images_without_a_checkpoint(tiny_mistral3_dir, tmp_path):
    """load_format="dummy" (benchmarks, the GPU check): the encoder's weights are seeded too, so
    two engines agree, and no safetensors file is read."""
    import shutil

    for path in tiny_mistral3_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, tmp_path / path.name)
    runs = [_generate(LLM(str(tmp_path), dtype="float32", num_gpu_blocks_override=64, load_format="dummy"), [ONE])
            for _ in range(2)]
    assert runs[0][0].outputs[0].token_ids == runs[1][0].outputs[0].token_ids


def test_a_requests_embeddings_rest_on_the_host():
    """An image is encoded when rows of it are first asked for; the lately encoded
    embeddings stay as the encoder gave them (on the device, in memory the KV cache sizing
    set aside), and a request's own copy rests on `host`, from which steps copy their rows
    ("meta" stands in here for a host apart from the device)."""
    from worker.core.multimodal import ImageInputs, ImageSpan
    from worker.model_executor.image_encoders import ImageEmbeddings

    embeds = ImageEmbeddings(host="meta")
    inputs = ImageInputs([torch.zeros(3)], torch.tensor([[16, 16]]), [ImageSpan(2, 4, 7)], [2, 3, 4, 5], [4])
    embeds.add(["r"], inputs)
    assert embeds.rows("r", 0, 2, 0) is None  # no image token in [0, 2)
    with pytest.raises(ValueError, match="not encoded"):
        embeds.rows("r", 0, 6, 10)
    encoded = []
    for start, end in ((0, 6), (4, 6)):
        embeds.encode("r", start, end, lambda pixels, sizes: encoded.append(1) or torch.ones(4, 8))
    assert len(encoded) == 1 and embeds.num_encoded == 1  # once
    rows, held = embeds.rows("r", 0, 6, 10)
    assert rows == [12, 13, 14, 15] and held.device.type == "meta" and held.shape == (4, 8)
    assert embeds.rows("r", 4, 6, 0)[0] == [0, 1]


def test_images_are_encoded_when_their_tokens_are_computed(tiny_mistral3_dir):
    """Three requests with an image each, one prefill a step: the first step encodes one
    image, not three. An image whose tokens the prefix cache holds whole is not encoded
    again (nor looked up), and the answer is the same."""
    llm = LLM(str(tiny_mistral3_dir), dtype="float32", num_gpu_blocks_override=64, max_num_seqs=1, block_size=16)
    embeds = llm.engine.runner.image_embeds
    for i in range(3):
        llm.engine.add_request(str(i), {"prompt": ONE[0], "multi_modal_data": {"image": [picture(40, 56, 20 + i)]}},
                               GREEDY)
    llm.engine.step()
    assert embeds.num_encoded == 1
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert embeds.num_encoded == 3
    case = ("Look: <issue_closed>" + " and then a long tail of words to fill more blocks" * 4, [picture(40, 56, 30)])
    first = _generate(llm, [case])[0]
    counts = (embeds.num_encoded, embeds.num_reused)
    again = _generate(llm, [case])[0]
    image_end = max(i for i, t in enumerate(first.prompt_token_ids) if t in (8, 9, 10))  # [IMG_END]
    assert again.num_cached_tokens > image_end
    assert (embeds.num_encoded, embeds.num_reused) == counts
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
