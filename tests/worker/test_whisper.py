"""Whisper, an encoder-decoder, on a tiny random checkpoint: greedy tokens against
transformers' WhisperForConditionalGeneration run step by step on the same clip (its feature
extractor, its encoder, every step's whole decoder), with several clips in one batch, through
the prefix cache and through preemption."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_audio import RATE, clip, wav
from test_engine import step_to_end

from producer.audio import read_clip
from worker import LLM, SamplingParams
from worker.model_executor.models.whisper import WhisperRules

START = 49152  # <|startoftranscript|> (the fixture's first added token)
PROMPT = [1, 50, 51, 52]  # the decoder's prompt, as token ids (the tiny model's start token is 1)
LONG_PROMPT = [1] + list(range(100, 120))  # past a block of 16: its blocks go to the prefix cache
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def hf_greedy(model_dir: Path, prompt: list[int], samples: np.ndarray, max_new: int = 12,
              suppressed: tuple[int, ...] = (), detecting: bool = False,
              logprobs: list[float] | None = None, forced: list[int] | None = None) -> list[int]:
    """transformers' greedy tokens: the whole decoder run again each step (no cache), the
    `suppressed` tokens masked, then transformers' own processors of the checkpoint's rules
    (begin_suppress_tokens; the timestamp rules where the prompt has no <|notimestamps|>),
    argmax of the last position's logits; `detecting` the language: no rules. `logprobs`
    gets each token's log-softmax of those logits; `forced` tokens are taken instead of the
    argmax (a sampled reply, weighed)."""
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration
    from transformers.generation.logits_process import (
        SuppressTokensAtBeginLogitsProcessor,
        WhisperTimeStampLogitsProcessor,
    )

    features = WhisperFeatureExtractor.from_pretrained(model_dir)(samples, sampling_rate=RATE, return_tensors="pt")
    model = WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    # (the file's fields as they are: transformers 5's GenerationConfig drops Whisper's own)
    rules = SimpleNamespace(**json.loads((model_dir / "generation_config.json").read_text()))
    processors = [SuppressTokensAtBeginLogitsProcessor(rules.begin_suppress_tokens, begin_index=len(prompt))]
    if rules.no_timestamps_token_id not in prompt:
        processors.append(WhisperTimeStampLogitsProcessor(rules, begin_index=len(prompt)))
    if detecting:
        processors = []
    ids = list(prompt)
    with torch.inference_mode():
        encoded = model.model.encoder(features["input_features"]).last_hidden_state
        for _ in range(max_new):
            scores = model(encoder_outputs=(encoded,), decoder_input_ids=torch.tensor([ids])).logits[:, -1]
            scores[:, list(suppressed)] = float("-inf")
            for processor in processors:
                scores = processor(torch.tensor([ids]), scores)
            ids.append(int(scores[0].argmax()) if forced is None else forced[len(ids) - len(prompt)])
            if logprobs is not None:
                logprobs.append(float(scores[0].log_softmax(-1)[ids[-1]]))
    return ids[len(prompt):]


def request(prompt: list[int], samples: np.ndarray) -> dict:
    return {"prompt_token_ids": prompt, "multi_modal_data": {"audio": (samples, RATE)}}


def audio_part(samples: np.ndarray) -> dict:
    """A chat content part with the clip as WAV."""
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav(samples)).decode(), "format": "wav"}}


@pytest.fixture(scope="module")
def llm(tiny_whisper_dir: Path) -> LLM:
    return LLM(str(tiny_whisper_dir), dtype="float32", num_gpu_blocks_override=64)


CLIPS = [clip(0.6, 1), clip(1.0, 2), clip(0.3, 3)]


def test_greedy_matches_transformers_for_clips_in_one_batch(llm: LLM, tiny_whisper_dir: Path) -> None:
    outputs = llm.generate([request(PROMPT, c) for c in CLIPS], GREEDY, use_tqdm=False)
    expected = [hf_greedy(tiny_whisper_dir, PROMPT, c) for c in CLIPS]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert len({tuple(e) for e in expected}) == 3  # each clip's own


def test_the_triton_backend_decodes_as_the_torch_one(tiny_whisper_dir: Path) -> None:
    """The CUDA path's attention (the Triton kernels; interpreted here) for the decoder's own
    attention, with and without timestamps."""
    runs = []
    prompts = [request(PROMPT, CLIPS[0]), request([START, START + 1], CLIPS[1])]  # (the second takes timestamps)
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_whisper_dir), dtype="float32", num_gpu_blocks_override=16, attention_backend=backend)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
    assert runs[0] == runs[1]
    assert runs[0][0] == hf_greedy(tiny_whisper_dir, PROMPT, CLIPS[0])


def test_a_clip_encoded_lately_is_not_encoded_again(llm: LLM, tiny_whisper_dir: Path) -> None:
    """Two samples of one prompt, then the same clip under another prompt (as a transcription
    after its language step): the encoder runs once; another clip runs it again."""
    embeds = llm.engine.runner.image_embeds
    samples = clip(0.7, 41)
    before = (embeds.num_encoded, embeds.num_reused)
    two = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2)
    pair = llm.generate([request(PROMPT, samples)], two, use_tqdm=False)[0]
    assert (embeds.num_encoded - before[0], embeds.num_reused - before[1]) == (1, 1)
    other = llm.generate([request(LONG_PROMPT, samples)], GREEDY, use_tqdm=False)[0]
    assert (embeds.num_encoded - before[0], embeds.num_reused - before[1]) == (1, 2)
    llm.generate([request(PROMPT, clip(0.7, 42))], GREEDY, use_tqdm=False)
    assert embeds.num_encoded - before[0] == 2
    expected = hf_greedy(tiny_whisper_dir, PROMPT, samples)
    assert [o.token_ids for o in pair.outputs] == [expected, expected]
    assert other.outputs[0].token_ids == hf_greedy(tiny_whisper_dir, LONG_PROMPT, samples)


def test_the_prefix_cache_tells_clips_apart(llm: LLM, tiny_whisper_dir: Path) -> None:
    """The same decoder prompt over another clip shares no block: its KV read another audio."""
    first = llm.generate([request(LONG_PROMPT, CLIPS[0])], GREEDY, use_tqdm=False)[0]
    second = llm.generate([request(LONG_PROMPT, CLIPS[1])], GREEDY, use_tqdm=False)[0]
    again = llm.generate([request(LONG_PROMPT, CLIPS[0])], GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens == 0 and again.num_cached_tokens == 16
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == hf_greedy(tiny_whisper_dir, LONG_PROMPT, CLIPS[0])
    assert second.outputs[0].token_ids == hf_greedy(tiny_whisper_dir, LONG_PROMPT, CLIPS[1])


def test_preempted_requests_encode_their_clip_again(tiny_whisper_dir: Path) -> None:
    """Six blocks of 16 for three requests that grow to 3 blocks each: some are preempted, give
    their audio's slot back, and take one again when they resume."""
    small = LLM(str(tiny_whisper_dir), dtype="float32", num_gpu_blocks_override=6, max_num_seqs=3)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = small.generate([request(PROMPT, c) for c in CLIPS], params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    for c, out in zip(CLIPS, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(tiny_whisper_dir, PROMPT, c, max_new=40)


def test_requests_run_at_once_as_their_audio_slots_fit_the_cache(tiny_whisper_dir: Path) -> None:
    """A cache that holds two requests' audio keys and values beside a whole sequence's KV each:
    two of four run at once (max_num_seqs is lowered), and every one decodes as transformers;
    a cache too small for one is refused by name."""
    per_request = 2 * 2 * 50 * 32 * 4 + 4 * (2 * 2 * 16 * 32 * 4)  # slot, and 4 blocks of KV (float32)
    small = LLM(str(tiny_whisper_dir), dtype="float32", max_num_seqs=4, kv_cache_memory_gb=2.5 * per_request / 2**30)
    engine = small.engine
    assert engine.max_num_seqs == len(engine.runner.cross) == 2
    tokens, most = step_to_end(engine, {str(k): (request(PROMPT, c), GREEDY) for k, c in enumerate(CLIPS)},
                               lambda: len(engine.runner.cross.slots))
    assert most == 2
    assert tokens == [hf_greedy(tiny_whisper_dir, PROMPT, c) for c in CLIPS]
    with pytest.raises(ValueError, match=r"one request needs 0 MiB .* more than the cache's 0 MiB"):
        LLM(str(tiny_whisper_dir), dtype="float32", kv_cache_memory_gb=0.5 * per_request / 2**30)


def hf_token_timestamps(model_dir: Path, prompt: list[int], samples: np.ndarray, tokens: list[int]) -> list[float]:
    """transformers' token timestamps of a reply (generate's return_token_timestamps): its own
    extraction over the cross-attention weights of a forward pass over the prompt and every
    reply token but the last, the clip's frames its feature extractor counts."""
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration
    from transformers.generation.utils import GenerateEncoderDecoderOutput

    batch = WhisperFeatureExtractor.from_pretrained(model_dir)(samples, sampling_rate=RATE, return_tensors="pt",
                                                               return_attention_mask=True)
    model = WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    heads = json.loads((model_dir / "generation_config.json").read_text())["alignment_heads"]
    with torch.inference_mode():
        out = model(input_features=batch["input_features"], decoder_input_ids=torch.tensor([prompt + tokens[:-1]]),
                    output_attentions=True)
        generated = GenerateEncoderDecoderOutput(sequences=torch.tensor([prompt + tokens]),
                                                 cross_attentions=(out.cross_attentions,))
        times = model._extract_token_timestamps(generated, heads, num_frames=int(batch["attention_mask"].sum()),
                                                num_input_ids=len(prompt))
    return times[0, len(prompt):].tolist()


def test_token_timestamps_are_transformers(llm: LLM, tiny_whisper_dir: Path, tmp_path: Path) -> None:
    """extra_args token_timestamps: the final output tells where in the clip each token was
    said, as transformers finds it (its alignment heads' cross-attention, time-warped), with
    timestamps and without; a checkpoint without alignment heads refuses the request."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, extra_args={"token_timestamps": True})
    prompts = [PROMPT, [START, START + 1], PROMPT]  # (the second writes timestamps)
    outputs = llm.generate([request(p, c) for p, c in zip(prompts, CLIPS, strict=True)], params, use_tqdm=False)
    for prompt, samples, out in zip(prompts, CLIPS, outputs, strict=True):
        tokens = out.outputs[0].token_ids
        expected = hf_token_timestamps(tiny_whisper_dir, prompt, read_clip(wav(samples), "clip", RATE), tokens)
        assert out.outputs[0].token_timestamps == pytest.approx(expected, abs=1e-6)
        assert max(expected) > 0  # (the path moves into the clip)
    assert llm.generate([request(PROMPT, CLIPS[0])], GREEDY, use_tqdm=False)[0].outputs[0].token_timestamps is None
    # a stop string ends the reply: the tokens it kept, timed
    tokens = outputs[0].outputs[0].token_ids
    stop = llm.get_tokenizer().decode(tokens[4:6])
    stopped = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop],
                             extra_args={"token_timestamps": True})
    [cut] = llm.generate([request(PROMPT, CLIPS[0])], stopped, use_tqdm=False)
    assert (cut.outputs[0].finish_reason, cut.outputs[0].stop_reason) == ("stop", stop)
    kept = cut.outputs[0].token_ids
    assert len(kept) < len(tokens) and kept == tokens[: len(kept)]
    expected = hf_token_timestamps(tiny_whisper_dir, PROMPT, read_clip(wav(CLIPS[0]), "clip", RATE), kept)
    assert cut.outputs[0].token_timestamps == pytest.approx(expected, abs=1e-6)
    model_dir = tmp_path / "whisper"
    shutil.copytree(tiny_whisper_dir, model_dir)
    config = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**config, "alignment_heads": None}))
    headless = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="names no alignment_heads"):
        headless.generate([request(PROMPT, CLIPS[0])], params, use_tqdm=False)


def test_a_chat_writes_the_decoder_prompt_from_its_variables(llm: LLM, tiny_whisper_dir: Path) -> None:
    """Whisper's template: the clip goes to the encoder, the text parts nowhere, and the prompt
    is written from language, task and prompt (or the start alone, to detect the language)."""
    part = audio_part(CLIPS[0])
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "ignored"}]}]
    encode = llm.get_tokenizer().encode
    cases = [({"language": "fr", "task": "translate"}, "<|startoftranscript|><|fr|><|translate|><|notimestamps|>"),
             ({"task": "transcribe", "prompt": " Earlier. "}, "<|startofprev|> Earlier.<|startoftranscript|><|transcribe|><|notimestamps|>"),
             ({"detect_language": True}, "<|startoftranscript|>")]
    for kwargs, written in cases:
        out = llm.chat(messages, GREEDY, use_tqdm=False, chat_template_kwargs=kwargs)[0]
        ids = encode(written, add_special_tokens=False)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(tiny_whisper_dir, ids, read_clip(wav(CLIPS[0]), "clip", RATE),
                                                     detecting="detect_language" in kwargs)


def test_the_rules_mask_as_transformers_processors_do() -> None:
    """WhisperRules against transformers' SuppressTokensAtBegin and WhisperTimeStamp processors
    on random outputs (text and timestamps mixed) and logits: the same logits come out."""
    from transformers.generation.logits_process import (
        SuppressTokensAtBeginLogitsProcessor,
        WhisperTimeStampLogitsProcessor,
    )

    vocab, no_timestamps, eos, prompt = 140, 99, 50, [1, 3, 2]
    rules = WhisperRules(no_timestamps, eos, begin_suppress=[eos, 7], max_initial=5, start=3)
    config = SimpleNamespace(no_timestamps_token_id=no_timestamps, eos_token_id=eos, max_initial_timestamp_index=5)
    theirs = [SuppressTokensAtBeginLogitsProcessor([eos, 7], begin_index=len(prompt)),
              WhisperTimeStampLogitsProcessor(config, begin_index=len(prompt))]
    rng = np.random.default_rng(0)
    for _ in range(300):
        output = [int(rng.integers(100, vocab) if rng.random() < 0.5 else rng.integers(4, 99))
                  for _ in range(int(rng.integers(0, 7)))]
        logits = torch.tensor(rng.normal(0, 3, vocab), dtype=torch.float32)
        expected = logits[None].clone()
        for processor in theirs:
            expected = processor(torch.tensor([prompt + output]), expected)
        assert torch.equal(rules.apply(prompt, output, logits.clone()), expected[0]), output
    assert torch.equal(rules.apply([*prompt, no_timestamps], [], logits.clone()),  # no timestamps: the start's rule alone
                       theirs[0](torch.tensor([prompt]), logits[None].clone())[0])
    assert torch.equal(rules.apply([1, 3], [], logits.clone()), logits)  # the language's step: none


def test_timestamps_follow_transformers_rules(llm: LLM, tiny_whisper_dir: Path) -> None:
    """A prompt without <|notimestamps|>: segments between timestamps, by transformers' own
    WhisperTimeStampLogitsProcessor, for each clip."""
    encode = llm.get_tokenizer().encode
    ids = encode("<|startoftranscript|><|en|>", add_special_tokens=False)
    first = encode("<|0.00|>", add_special_tokens=False)[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for samples in CLIPS:
        part = audio_part(samples)
        out = llm.chat([{"role": "user", "content": [part]}], params, use_tqdm=False,
                       chat_template_kwargs={"language": "en", "timestamps": True})[0]
        tokens = out.outputs[0].token_ids
        assert out.prompt_token_ids == ids
        assert tokens == hf_greedy(tiny_whisper_dir, ids, read_clip(wav(samples), "clip", RATE), max_new=40)
        stamps = [t for t in tokens if t >= first]
        assert tokens[0] in range(first, first + 11) and stamps == sorted(stamps)


def test_the_checkpoints_suppressed_tokens_are_never_written(tiny_whisper_dir: Path, tmp_path: Path) -> None:
    """generation_config.json's suppress_tokens, masked at every step as transformers' generate
    does: here the tokens the model writes first for the clip, so it writes others."""
    plain = hf_greedy(tiny_whisper_dir, PROMPT, CLIPS[0])
    suppressed = tuple(dict.fromkeys(plain[:2]))
    model_dir = tmp_path / "whisper"
    shutil.copytree(tiny_whisper_dir, model_dir)
    config = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**config, "suppress_tokens": list(suppressed)}))
    out = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=16).generate(
        [request(PROMPT, CLIPS[0])], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(tiny_whisper_dir, PROMPT, CLIPS[0], suppressed=suppressed)
    # ids past the vocabulary (whisper's own, in a config over a smaller one) mask nothing, as in transformers
    (model_dir / "generation_config.json").write_text(json.dumps({
        **config, "suppress_tokens": [*suppressed, 50362], "begin_suppress_tokens": [2, 220, 50256]}))
    out = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=16).generate(
        [request(PROMPT, CLIPS[0])], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(tiny_whisper_dir, PROMPT, CLIPS[0], suppressed=suppressed)
    assert not set(out.outputs[0].token_ids) & set(suppressed)


def test_an_english_only_checkpoint_writes_no_language_or_task(tiny_whisper_dir: Path, tmp_path: Path) -> None:
    """generation_config's is_multilingual false (whisper-*.en): the prompt is the start (and
    <|notimestamps|> unless timestamps are asked for), whatever the variables say, and the
    timestamp rules hold right after the start."""
    model_dir = tmp_path / "whisper-en"
    shutil.copytree(tiny_whisper_dir, model_dir)
    config = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**config, "is_multilingual": False}))
    english = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=16)
    part = audio_part(CLIPS[1])
    samples = read_clip(wav(CLIPS[1]), "clip", RATE)
    for timestamps, prompt in ((False, [START, START + 8]), (True, [START])):
        out = english.chat([{"role": "user", "content": [part]}], GREEDY, use_tqdm=False,
                           chat_template_kwargs={"language": "fr", "task": "translate", "timestamps": timestamps})[0]
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, samples)


def test_whisper_refuses_what_it_cannot_run(llm: LLM, tiny_whisper_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"reads an audio clip with its prompt: give one as multi_modal_data"):
        llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="a Whisper prompt takes exactly one audio clip, got 2"):
        llm.generate([{"prompt_token_ids": PROMPT, "multi_modal_data": {"audio": CLIPS[:2]}}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="Whisper runs without tensor_parallel_size > 1, enable_lora"):
        LLM(str(tiny_whisper_dir), tensor_parallel_size=2, enable_lora=True)
