"""Audio clips in Qwen2-Audio prompts, on a tiny Qwen2-Audio: greedy tokens against
transformers' Qwen2AudioForConditionalGeneration given the same samples (its Whisper feature
extractor, its audio tower, its placeholder count), clips given as samples, WAV and FLAC bytes
and chat parts; and the reading of clips (WAV decoding, resampling) against numbers worked out
by hand."""

from __future__ import annotations

import base64
import io
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from producer.audio import read_clip, resample, to_wav
from worker import LLM, SamplingParams

RATE = 16_000
AUDIO = "<issue_start><issue_closed><issue_comment>"  # the fixture's audio bos, <|AUDIO|> (id 10), audio eos
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def clip(seconds: float, seed: int, rate: int = RATE) -> np.ndarray:
    """A few tones and some noise: different clips give different features."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    tones = sum(rng.uniform(0.1, 0.3) * np.sin(2 * np.pi * rng.uniform(100, 3000) * t) for _ in range(3))
    return (tones + rng.normal(0, 0.02, t.shape)).astype(np.float32)


def pcm16(samples: np.ndarray) -> np.ndarray:
    return np.clip(np.round(samples * 32767), -32768, 32767).astype("<i2")


def flac(samples: np.ndarray, rate: int = RATE) -> bytes:
    """FLAC bytes of the 16-bit samples wav() writes: lossless, so they read back the same."""
    import soundfile

    out = io.BytesIO()
    soundfile.write(out, pcm16(samples), rate, format="FLAC", subtype="PCM_16")
    return out.getvalue()


def wav(samples: np.ndarray, rate: int = RATE, channels: int = 1) -> bytes:
    """16-bit PCM WAV bytes of `samples` (repeated on each channel)."""
    ints = pcm16(samples)
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(channels)
        writer.setsampwidth(2)
        writer.setframerate(rate)
        writer.writeframes(np.repeat(ints, channels).tobytes())
    return out.getvalue()


def hf_greedy(model_dir: Path, text: str, clips: list[np.ndarray], max_new: int = 10) -> list[int]:
    """transformers' greedy tokens for a prompt whose audio tokens stand for `clips`, each
    <|AUDIO|> widened as Qwen2AudioProcessor does."""
    from transformers import (
        AutoTokenizer,
        Qwen2AudioForConditionalGeneration,
        WhisperFeatureExtractor,
    )

    features = WhisperFeatureExtractor.from_pretrained(model_dir)(
        clips, sampling_rate=RATE, return_attention_mask=True, padding="max_length", return_tensors="pt")
    pieces = text.split("<issue_closed>")
    expanded = pieces[0]
    for length, rest in zip(features["attention_mask"].sum(-1).tolist(), pieces[1:], strict=True):
        expanded += "<issue_closed>" * ((((length - 1) // 2 + 1) - 2) // 2 + 1) + rest
    ids = AutoTokenizer.from_pretrained(model_dir).encode(expanded)
    model = Qwen2AudioForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), input_features=features["input_features"],
                             feature_attention_mask=features["attention_mask"], max_new_tokens=max_new,
                             do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def llm(tiny_qwen2_audio_dir: Path) -> LLM:
    return LLM(str(tiny_qwen2_audio_dir), dtype="float32", num_gpu_blocks_override=64, max_num_batched_tokens=24)


ONE = (f"Listen: {AUDIO} What is it?", [clip(0.6, 1)])
TWO = (f"First {AUDIO} then {AUDIO}, compare.", [clip(0.25, 2), clip(1.0, 3)])


def test_greedy_matches_transformers_with_clips(llm: LLM, tiny_qwen2_audio_dir: Path) -> None:
    """Chunks of 24 tokens cut through the clips' tokens; one clip fills the whole window."""
    prompts = [{"prompt": text, "multi_modal_data": {"audio": clips}} for text, clips in (ONE, TWO)]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert outputs[0].prompt_token_ids.count(10) == 15  # 60 mel frames: 30 positions, pooled to 15
    assert outputs[1].prompt_token_ids.count(10) == 6 + 25  # 25 frames: 13 positions, 6; the whole window: 25
    for (text, clips), out in zip((ONE, TWO), outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(tiny_qwen2_audio_dir, text, clips)


def test_clips_as_wav_bytes_and_chat_parts(llm: LLM, tiny_qwen2_audio_dir: Path) -> None:
    """A WAV at 8 kHz in two channels is read as the mono 16 kHz clip it holds; OpenAI's
    input_audio part and vLLM's audio_url part carry it in a chat, as the prompt form does."""
    samples = clip(0.5, 4, rate=8000)
    data = wav(samples, rate=8000, channels=2)
    read = read_clip(data, "audio 0", RATE)
    assert len(read) == 8000
    by_bytes = llm.generate({"prompt": ONE[0], "multi_modal_data": {"audio": data}}, GREEDY, use_tqdm=False)
    assert by_bytes[0].outputs[0].token_ids == hf_greedy(tiny_qwen2_audio_dir, ONE[0], [read])
    assert np.array_equal(read_clip(flac(samples, rate=8000), "audio 0", RATE), read)  # FLAC, through libsndfile
    encoded = base64.b64encode(data).decode()
    parts = [{"type": "input_audio", "input_audio": {"data": encoded, "format": "wav"}},
             {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{encoded}"}}]
    chats = [[{"role": "user", "content": [{"type": "text", "text": "Hear "}, part]}] for part in parts]
    replies = llm.chat(chats, GREEDY, use_tqdm=False)
    text = "<|im_start|>user\nHear " + AUDIO + "<|im_end|>\n<|im_start|>assistant\n"
    expected = hf_greedy(tiny_qwen2_audio_dir, text, [read])
    assert [r.outputs[0].token_ids for r in replies] == [expected, expected]


def test_the_prefix_cache_tells_clips_apart(tiny_qwen2_audio_dir: Path) -> None:
    """The same words around another clip share blocks only up to the clip's; around the same
    clip again, past it, and the clip is not encoded again."""
    llm = LLM(str(tiny_qwen2_audio_dir), dtype="float32", num_gpu_blocks_override=64, block_size=16)
    text = ("Some words to fill the first block of sixteen tokens, and more of them. " * 2 + f"Now: {AUDIO}."
            + " And then more words after the clip, enough to fill its block and another.")
    first, second = clip(0.4, 31), clip(0.4, 32)
    ran = [llm.generate({"prompt": text, "multi_modal_data": {"audio": [c]}}, GREEDY, use_tqdm=False)[0]
           for c in (first, second, first)]
    start = ran[0].prompt_token_ids.index(10)
    assert ran[1].num_cached_tokens == start // 16 * 16
    assert ran[2].num_cached_tokens > start + 10
    assert ran[2].outputs[0].token_ids == ran[0].outputs[0].token_ids
    assert llm.engine.runner.image_embeds.num_encoded == 2


def test_bad_clips_fail_with_the_reason(llm: LLM) -> None:
    cases = [
        ({"audio": clip(1.5, 5)}, "lasts 1.5 s, longer than the model's window of 1 s"),
        ({"audio": b"ID3\x04" + bytes(40)}, "audio 0 is not audio that can be read (WAV, MP3, FLAC, OGG, ...)"),
        ({"audio": [clip(0.2, 6), clip(0.2, 7)]}, "1 audio placeholder(s) (token id 10) but 2 audio item(s)"),
        ({"image": b"\x89PNG"}, "kind 'image' is not supported by this model; it takes: audio"),
        ({"audio": (clip(0.2, 8), 0)}, "sampling rate must be a positive number"),
        ({"audio": clip(0.01, 9)}, "audio 0 lasts 10 ms, too short to make a single audio token"),
    ]
    for data, message in cases:
        with pytest.raises(ValueError, match=None) as info:
            llm.generate({"prompt": ONE[0], "multi_modal_data": data}, GREEDY, use_tqdm=False)
        assert message in str(info.value), (message, str(info.value))


def test_wav_decoding_and_resampling_by_hand() -> None:
    """8, 16, 24 and 32-bit PCM decode to the same samples; a tone resampled from 8 kHz to
    16 kHz is the tone sampled at 16 kHz, and one above 8 kHz's Nyquist frequency is cut."""
    ramp = np.array([0.0, 0.25, -0.5, 0.75, -1.0], dtype=np.float32)
    for width, scale, kind in ((1, 128, "u1"), (2, 2**15, "<i2"), (4, 2**31, "<i4")):
        offset = 128 if width == 1 else 0  # 8-bit PCM is unsigned
        ints = (ramp * scale + offset).clip(-scale + offset, scale - 1 + offset).astype(kind)
        data = io.BytesIO()
        with wave.open(data, "wb") as writer:
            writer.setnchannels(1)
            writer.setsampwidth(width)
            writer.setframerate(RATE)
            writer.writeframes(ints.tobytes())
        assert np.allclose(read_clip(data.getvalue(), "audio 0", RATE), ramp, atol=1 / 127), width
    sixteen = wav(clip(0.1, 30))  # 16-bit mono at 16 kHz: what the API queues, back byte for byte
    assert to_wav(read_clip(sixteen, "audio 0", RATE), RATE) == sixteen
    t8, t16 = np.arange(800) / 8000, np.arange(1600) / 16000
    tone = np.sin(2 * np.pi * 500 * t8)  # whole periods: its spectrum is exact
    assert np.allclose(resample(tone, 8000, 16000), np.sin(2 * np.pi * 500 * t16), atol=1e-6)
    high = np.sin(2 * np.pi * 6000 * t16)
    assert np.abs(resample(high, 16000, 8000)).max() < 1e-6
