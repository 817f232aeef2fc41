"""Images in Qwen2.5-VL prompts, on a tiny Qwen2.5-VL (and Qwen2-VL): greedy tokens against
transformers' Qwen2_5_VLForConditionalGeneration given the same pixels. Its M-RoPE places an image's
tokens by their row and column, so these check the positions (three streams in the prompt,
one shifted stream after it) as much as the embeddings: whole, in chunks that cut through
an image, on the Triton path (decode graphs replayed eagerly on CPU), and with the prefix
cache. transformers' Qwen2-VL processor needs torchvision, absent here: its image processor
on PIL makes the pixels, and its placeholder expansion is written out below."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_images import CHAT_TEXT, GREEDY, _generate, chat_about, picture

from worker import LLM, RequestsFailed, SamplingParams

# the fixture's <|vision_start|>, <|image_pad|> (token id 10) and <|vision_end|>; two patches merged each way
IMAGE_PAD = "<issue_closed>"
IMAGE = "<issue_start>" + IMAGE_PAD + "<issue_comment>"
MERGE = 2


def hf_greedy(model_dir: Path, text: str, images: list, max_new: int = 12) -> list[int]:
    """transformers' greedy tokens for a prompt whose image pads stand for `images`."""
    return hf_greedy_logprobs(model_dir, text, images, max_new)[0]


def hf_greedy_logprobs(model_dir: Path, text: str, images: list, max_new: int = 12) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens, and each one's logprob."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    features = AutoImageProcessor.from_pretrained(model_dir, backend="pil")(images=images, return_tensors="pt")
    pieces = text.split(IMAGE_PAD)
    expanded = pieces[0]
    for grid, rest in zip(features["image_grid_thw"], pieces[1:], strict=True):
        expanded += IMAGE_PAD * (int(grid.prod()) // MERGE**2) + rest  # Qwen2VLProcessor's expansion
    ids = AutoTokenizer.from_pretrained(model_dir).encode(expanded)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), pixel_values=features["pixel_values"],
                             image_grid_thw=features["image_grid_thw"],
                             mm_token_type_ids=torch.tensor([[int(i == 10) for i in ids]]),
                             max_new_tokens=max_new, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [float(row[0].log_softmax(-1)[t]) for row, t in zip(out.logits, tokens, strict=True)]


# 40 x 56 pixels resize to 32 x 64 (multiples of 16, nearest): 2 x 4 merged patches; 64 x 32 to
# 4 x 2; 20 x 64 to 1 x 4
ONE = (f"Describe {IMAGE} in a word:", [picture(40, 56, 0)])
TWO = (f"Compare {IMAGE} with {IMAGE}, please.", [picture(64, 32, 1), picture(20, 64, 2)])


def test_greedy_matches_transformers_with_images(tiny_qwen_vl_dir):
    llm = LLM(str(tiny_qwen_vl_dir), dtype="float32", num_gpu_blocks_override=64)
    outputs = _generate(llm, [ONE, TWO])
    assert outputs[0].prompt_token_ids.count(10) == 2 * 4
    assert outputs[1].prompt_token_ids.count(10) == 4 * 2 + 1 * 4
    for (text, images), out in zip([ONE, TWO], outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(tiny_qwen_vl_dir, text, images)


def test_chunks_cut_through_the_images(tiny_qwen_vl_dir):
    """Chunks of 8 tokens: an image's embeddings and its three-stream positions are split
    across steps, and a step holds one request's image rows beside another's text."""
    llm = LLM(str(tiny_qwen_vl_dir), dtype="float32", num_gpu_blocks_override=64, max_num_batched_tokens=8,
              max_num_seqs=2)
    outputs = _generate(llm, [TWO, ONE])
    assert [out.outputs[0].token_ids for out in outputs] == [hf_greedy(tiny_qwen_vl_dir, *case) for case in (TWO, ONE)]


def test_the_triton_path_rotates_by_the_three_streams(tiny_qwen_vl_dir):
    """The rotary kernel takes each step's mixed table rows in the prompt, and the decode
    graphs (replayed eagerly on CPU) the shifted positions after it."""
    llm = LLM(str(tiny_qwen_vl_dir), dtype="float32", num_gpu_blocks_override=64, attention_backend="triton",
              device="cuda" if torch.cuda.is_available() else "cpu")
    outputs = _generate(llm, [ONE, TWO])
    assert sum(llm.engine.runner.graphs.num_steps.values()) > 0
    assert [out.outputs[0].token_ids for out in outputs] == [hf_greedy(tiny_qwen_vl_dir, *case) for case in (ONE, TWO)]


def test_recomputed_after_preemption(tiny_qwen_vl_dir):
    """A pool too small for the batch preempts requests: their recomputation places the
    generated tokens after the prompt's images by the delta again."""
    cases = [(f"{IMAGE} number {i}", [picture(40 + 8 * i, 56, 10 + i)]) for i in range(4)]
    llm = LLM(str(tiny_qwen_vl_dir), dtype="float32", num_gpu_blocks_override=6, block_size=8, max_model_len=40,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}} for text, images in cases],
                           params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [out.outputs[0].token_ids for out in outputs] == [hf_greedy(tiny_qwen_vl_dir, *case, max_new=16)
                                                            for case in cases]


def check_image_prefixes(llm: LLM, model_dir: Path) -> None:
    """A prompt again with another image is served from the cache up to the image's block;
    with the same image, past it (the image not encoded again); greedy tokens equal
    transformers'."""
    text = "Some words to fill the first block of sixteen tokens, and more of them. " * 2 + f"Now: {IMAGE}."
    first, second = picture(64, 64, 3), picture(64, 64, 4)
    ran = [_generate(llm, [(text, [image])])[0] for image in (first, second, first)]
    start = ran[0].prompt_token_ids.index(10)
    assert ran[1].num_cached_tokens == start // 16 * 16
    assert ran[2].num_cached_tokens > start
    assert ran[2].outputs[0].token_ids == ran[0].outputs[0].token_ids
    assert [r.outputs[0].token_ids for r in ran[:2]] == [hf_greedy(model_dir, text, [i]) for i in (first, second)]


def test_the_prefix_cache_tells_images_apart(tiny_qwen_vl_dir):
    check_image_prefixes(LLM(str(tiny_qwen_vl_dir), dtype="float32", num_gpu_blocks_override=64, block_size=16),
                         tiny_qwen_vl_dir)


def test_chat_messages_carry_images(tiny_qwen_vl_dir):
    image = picture(48, 48, 5)
    out = chat_about(LLM(str(tiny_qwen_vl_dir), dtype="float32", num_gpu_blocks_override=64), image, GREEDY)
    assert out.outputs[0].token_ids == hf_greedy(tiny_qwen_vl_dir, CHAT_TEXT.format(IMAGE), [image])


@pytest.mark.parametrize("version", ["qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5"])
def test_qwen2_vl_and_qwen3_vl_match_transformers(version, tiny_qwen_vl):
    """Qwen2-VL: the same prompts and positions, its vision transformer without windows.
    Qwen3-VL: M-RoPE's streams interleaved over the rotary pairs, and deepstack embeddings
    added after the first layers (whose effect on the tiny model's logits is a tenth, too
    small to change greedy tokens: the logprobs tell); Qwen3-VL-MoE, the same around
    routed experts; Qwen3.5, the same streams over a quarter of each head, beside linear
    attention's states. Whole, and in chunks that cut through the images."""
    model_dir = tiny_qwen_vl(version)
    expected = [hf_greedy_logprobs(model_dir, *case) for case in (ONE, TWO)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    for chunk in ({}, {"max_num_batched_tokens": 8, "max_num_seqs": 2}):
        llm = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64, **chunk)
        outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}} for text, images in (ONE, TWO)],
                               params, use_tqdm=False)
        for out, (tokens, logprobs) in zip(outputs, expected, strict=True):
            assert out.outputs[0].token_ids == tokens
            assert [entry.logprob for entry in out.outputs[0].logprobs] == pytest.approx(logprobs, abs=1e-4)


def hub_layout(model_dir: Path, out: Path) -> Path:
    """A Qwen3-VL-MoE checkpoint as the Hub holds it: stacked experts inputs first ([E, H, 2I],
    [E, I, H]), where transformers 5 saves them outputs first."""
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir()
    for path in model_dir.iterdir():
        if path.suffix == ".safetensors":
            tensors = load_file(path)
            save_file({name: t.transpose(1, 2).contiguous() if name.endswith(("experts.gate_up_proj", "experts.down_proj"))
                       else t for name, t in tensors.items()}, out / path.name, metadata={"format": "pt"})
        elif path.is_file():
            shutil.copy(path, out / path.name)
    return out


def test_qwen3_vl_moe_reads_the_hubs_expert_layout(tiny_qwen_vl, tmp_path):
    """The Hub's layout and transformers 5's load to the same model."""
    moe_dir = tiny_qwen_vl("qwen3_vl_moe")
    runs = [_generate(LLM(str(model), dtype="float32", num_gpu_blocks_override=64), [ONE])[0].outputs[0].token_ids
            for model in (moe_dir, hub_layout(moe_dir, tmp_path / "hub"))]
    assert runs[0] == runs[1]


def test_mm_processor_kwargs_bound_an_images_tokens(tiny_qwen_vl_dir, tmp_path):
    """max_pixels 32 x 32 (vLLM's mm_processor_kwargs): the 40 x 56 image takes 1 x 2 merged
    patches, not 2 x 4, and the tokens are transformers' given the processor so set; a
    setting the processor does not take is refused by name."""
    from transformers import Qwen2VLImageProcessorPil

    llm = LLM(str(tiny_qwen_vl_dir), dtype="float32", num_gpu_blocks_override=64,
              mm_processor_kwargs={"max_pixels": 32 * 32})
    out = _generate(llm, [ONE])[0]
    assert out.prompt_token_ids.count(10) == 1 * 2
    import shutil

    bounded = tmp_path / "bounded"  # the same checkpoint, its image processor saved with the override
    shutil.copytree(tiny_qwen_vl_dir, bounded)
    Qwen2VLImageProcessorPil.from_pretrained(tiny_qwen_vl_dir, max_pixels=32 * 32).save_pretrained(bounded)
    assert out.outputs[0].token_ids == hf_greedy(bounded, *ONE)
    with pytest.raises(ValueError, match="Qwen2VLImageProcessorPil takes no 'max_pixel'; it takes .*max_pixels"):
        LLM(str(tiny_qwen_vl_dir), dtype="float32", num_gpu_blocks_override=64, mm_processor_kwargs={"max_pixel": 1})


def test_an_image_the_encoder_fails_on_ends_its_request_alone(tiny_qwen_vl_dir, caplog):
    """Pixels that do not fit their patch grid (prepared elsewhere, as the queue worker's
    thread prepares them): the vision transformer raises when the step reaches the image.
    That request ends (abort) and the others in the step go on, as transformers answers;
    generate raises naming it, with every output."""
    from worker.core.multimodal import PreparedImages

    llm = LLM(str(tiny_qwen_vl_dir), dtype="float32", num_gpu_blocks_override=64)
    good = llm.engine.image_processor.prepare(ONE[1])
    bad = PreparedImages([good.pixel_values[0][:-3]], good.image_sizes, [12345])  # 3 patches short
    two = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2)  # the samples of one prompt
    with pytest.raises(RequestsFailed, match=r"^1 of 2 prompts failed as they ran \(prompt 0: .*could not be encoded"
                                             ) as failed:
        llm.generate([{"prompt": ONE[0], "multi_modal_data": {"image": bad}},
                      {"prompt": ONE[0], "multi_modal_data": {"image": good}}], [two, GREEDY], use_tqdm=False)
    outputs = failed.value.outputs
    assert [(c.finish_reason, c.token_ids) for c in outputs[0].outputs] == [("abort", [])] * 2  # both end at once
    assert list(failed.value.failures) == [0] and llm.engine.take_failures() == {}
    assert sum("could not be encoded" in r.getMessage() for r in caplog.records) == 1  # the sibling never ran
    assert outputs[1].outputs[0].token_ids == hf_greedy(tiny_qwen_vl_dir, *ONE)
    assert not llm.engine.has_unfinished_requests()


async def test_a_queued_job_whose_images_fail_to_encode_fails_with_why(tiny_qwen_vl_dir):
    """Through the worker's engine thread: the job is rejected with the encoder's error (the
    consumer fails it with that message), not reported as an abort; a job beside it runs to
    its end."""
    import asyncio
    from concurrent.futures import Future

    from producer.protocol import Job
    from worker.config import EngineConfig
    from worker.core.multimodal import PreparedImages
    from worker.queue.engine_thread import AddRequest, EngineThread

    thread = EngineThread(EngineConfig(model=str(tiny_qwen_vl_dir), dtype="float32", num_gpu_blocks_override=64),
                          asyncio.get_running_loop())
    engine = await thread.start()
    good = engine.image_processor.prepare(ONE[1])
    messages = [{"role": "user", "content": f"What is in {IMAGE}"}]  # the placeholder written out
    for engine_id, images in (("bad", PreparedImages([good.pixel_values[0][:-3]], good.image_sizes, [1])),
                              ("good", good)):
        prepared: Future = Future()
        prepared.set_result(images)
        job = Job(id=engine_id, sampling_params=GREEDY, messages=messages)
        thread._commands.put(AddRequest(engine_id, job, images=prepared))  # the images as prepared, not re-read
    rejected, finished = [], []
    async with asyncio.timeout(30):
        while not finished and len(rejected) < 2:
            result = await thread.results.get()
            rejected += result.rejected
            finished += [o.request_id for o in result.outputs if o.finished]
    thread.stop(10.0)
    assert [(r.engine_id, r.error_type) for r in rejected] == [("bad", None)]  # not known to be the job's fault
    assert rejected[0].error.startswith("its images could not be encoded: RuntimeError")
    assert finished == ["good"]


def test_qwen3_5_serves_image_prefixes_from_the_states_it_keeps(tiny_qwen_vl):
    """Qwen3.5 keeps linear attention's states every 16 tokens for its prefix cache: a prompt
    again with another image starts from the state before the image, with the same image
    from one after it (not encoding it again); greedy tokens equal transformers'."""
    model_dir = tiny_qwen_vl("qwen3_5")
    llm = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64, mamba_block_size=16,
              num_state_snapshots=16)
    check_image_prefixes(llm, model_dir)
