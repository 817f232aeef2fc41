"""OpenAI's audio endpoints on Whisper, through a live worker serving the tiny Whisper, driven
by the official `openai` client: the decoder's prompt written from the form (language, task,
prompt), the language heard where the form gives none, pieces of a long upload. The oracle is
the offline engine's chat with Whisper's template (checked against transformers in
tests/worker/test_whisper.py)."""

from __future__ import annotations

import base64
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import redis

from api.settings import Settings
from api.transcriptions import duration_s, joined, split_wav
from producer.audio import AUDIO_RATE, read_clip, to_wav
from producer.protocol import Keys
from producer.records import decode_worker_info
from worker import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent.parent / "worker"))
from test_audio import clip, wav  # noqa: E402 (the worker tests' clips)

WAV = wav(clip(0.6, 31))
LONG = wav(np.concatenate([clip(0.9, 32), np.zeros(800, np.float32), clip(0.8, 33)]))  # two pieces of a 1 s window
FORM = {"extra_body": {"max_tokens": 6, "ignore_eos": True}}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


# a request's audio slot and its 4 blocks of KV cache (float32): the worker's cache holds 2.5
PER_REQUEST = 2 * 2 * 50 * 32 * 4 + 4 * (2 * 2 * 16 * 32 * 4)
WORKER = "whisper"


@pytest.fixture(scope="module")
def live_worker(stack_redis, tiny_whisper_dir: Path, run_worker, tmp_path_factory) -> Iterator[str]:
    with run_worker(stack_redis.url, tiny_whisper_dir, tmp_path_factory.mktemp("whisper-worker"),
                    ("--max-model-len", "64",  # (its decoder's positions)
                     "--kv-cache-memory-gb", str(2.5 * PER_REQUEST / 2**30)), WORKER) as url:
        yield url


@pytest.fixture(scope="module")
def api_url(live_worker: str, serve_api) -> Iterator[str]:
    with serve_api(Settings(redis_url=live_worker, request_timeout_s=60.0, audio_chunk_s=1.0)) as url:
        yield url


@pytest.fixture(scope="module")
def llm(tiny_whisper_dir: Path) -> LLM:
    return LLM(str(tiny_whisper_dir), dtype="float32", num_gpu_blocks_override=64)


def pieces_of(audio: bytes) -> list[bytes]:
    """`audio` in the pieces the API cuts it into (as its 16 kHz WAV, at the tiny model's 1 s)."""
    return split_wav(to_wav(read_clip(audio, "clip", AUDIO_RATE), AUDIO_RATE), 1.0)


def offline(llm: LLM, audio: bytes, **variables: str) -> str:
    """The offline engine's text for each piece of `audio` under Whisper's template, joined."""
    chats = [[{"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": base64.b64encode(piece).decode(), "format": "wav"}}]}] for piece in pieces_of(audio)]
    replies = llm.chat(chats, GREEDY, use_tqdm=False, chat_template_kwargs=variables)
    return joined([r.outputs[0].text for r in replies])


def heard(llm: LLM, audio: bytes) -> str:
    """The language the offline engine hears in the first piece: its one token among the
    language tokens."""
    audio = pieces_of(audio)[0]
    tokenizer = llm.get_tokenizer()
    ids = {tokenizer.convert_tokens_to_ids(f"<|{code}|>"): code for code in ("en", "fr", "de")}
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(audio).decode(), "format": "wav"}}
    params = SamplingParams(temperature=0.0, max_tokens=1, allowed_token_ids=sorted(ids))
    out = llm.chat([{"role": "user", "content": [part]}], params, use_tqdm=False,
                   chat_template_kwargs={"detect_language": True})[0]
    return ids[out.outputs[0].token_ids[0]]


def test_a_transcription_writes_whispers_prompt_from_the_form(oai: openai.OpenAI, served_model: str, llm: LLM) -> None:
    got = oai.audio.transcriptions.create(model=served_model, file=("clip.wav", WAV), language="de",
                                          prompt="Vorher.", **FORM)
    assert got.text == offline(llm, WAV, language="de", task="transcribe", prompt="Vorher.")
    translated = oai.audio.translations.create(model=served_model, file=("clip.wav", WAV), **FORM)
    language = heard(llm, WAV)
    assert translated.text == offline(llm, WAV, language=language, task="translate")


def test_without_a_language_the_one_heard_is_used(oai: openai.OpenAI, served_model: str, llm: LLM) -> None:
    """A long upload: the language heard in its first piece, then a job per piece."""
    language = heard(llm, LONG)
    expected = offline(llm, LONG, language=language, task="transcribe")
    got = oai.audio.transcriptions.create(model=served_model, file=("long.wav", LONG), **FORM)
    assert (got.text, got.usage.type, got.usage.seconds) == (expected, "duration", 2)  # whisper-1's: 1.75 s, up
    verbose = oai.audio.transcriptions.create(model=served_model, file=("long.wav", LONG),
                                              response_format="verbose_json", **FORM)
    assert (verbose.language, verbose.duration) == ({"en": "english", "fr": "french", "de": "german"}[language], 1.75)
    events = list(oai.audio.transcriptions.create(model=served_model, file=("long.wav", LONG), stream=True, **FORM))
    assert events[-1].type == "transcript.text.done" and events[-1].text == expected
    assert events[-1].usage.seconds == 2


def offline_tokens(llm: LLM, audio: bytes, **variables) -> list[list[int]]:
    """The offline engine's tokens for each piece of `audio` under Whisper's template."""
    chats = [[{"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": base64.b64encode(piece).decode(), "format": "wav"}}]}] for piece in pieces_of(audio)]
    return [r.outputs[0].token_ids for r in llm.chat(chats, GREEDY, use_tqdm=False, chat_template_kwargs=variables)]


def runs(tokens: list[int], first: int) -> list[tuple[float | None, list[int], float | None]]:
    """The text between timestamps: (the time before, the text's tokens, the time after)."""
    out, before, text = [], None, []
    for token in tokens:
        if token < first:
            text.append(token)
            continue
        if text:
            out.append((before, text, (token - first) * 0.02))
            text = []
        before = (token - first) * 0.02
    return out + ([(before, text, None)] if text else [])


def test_timestamps_give_segments_and_subtitles(oai: openai.OpenAI, served_model: str, llm: LLM) -> None:
    """verbose_json's segments, srt and vtt: the text between the timestamps the model writes
    (its prompt without <|notimestamps|>), each piece's times after the pieces before it."""
    tokenizer = llm.get_tokenizer()
    first = tokenizer.convert_tokens_to_ids("<|0.00|>")
    pieces = offline_tokens(llm, LONG, language="en", task="transcribe", timestamps=True)
    offsets = [0.0, duration_s(pieces_of(LONG)[0])]
    expected = [(run, offset) for tokens, offset in zip(pieces, offsets, strict=True) for run in runs(tokens, first)
                if tokenizer.decode(run[1], skip_special_tokens=True).strip()]
    verbose = oai.audio.transcriptions.create(model=served_model, file=("long.wav", LONG), language="en",
                                              response_format="verbose_json", timestamp_granularities=["segment"],
                                              **FORM)
    segments = verbose.segments
    assert len(segments) >= 2 and segments[-1].start >= offsets[1]  # (both pieces have some)
    assert [s.tokens for s in segments] == [run[1] for run, _ in expected]
    assert [s.text for s in segments] == [tokenizer.decode(run[1], skip_special_tokens=True) for run, _ in expected]
    for segment, ((before, _, after), offset) in zip(segments, expected, strict=True):
        if before is not None:
            assert segment.start == round(offset + before, 2)
        if after is not None:
            assert segment.end == round(offset + after, 2)
    assert verbose.text == joined([s.text for s in segments])
    srt = oai.audio.transcriptions.create(model=served_model, file=("long.wav", LONG), language="en",
                                          response_format="srt", **FORM)
    cues = srt.strip().split("\n\n")
    assert len(cues) == len(segments) and cues[0].split("\n")[0] == "1"
    assert cues[0].split("\n")[1] == f"00:00:00,{round(segments[0].start * 1000):03d} --> 00:00:00,{round(segments[0].end * 1000):03d}"
    vtt = oai.audio.transcriptions.create(model=served_model, file=("long.wav", LONG), language="en",
                                          response_format="vtt", **FORM)
    assert vtt.startswith("WEBVTT\n\n") and vtt.count(" --> ") == len(segments) and "00:00:00." in vtt


def test_a_long_prompt_keeps_its_last_tokens(oai: openai.OpenAI, served_model: str, llm: LLM) -> None:
    """The form's prompt (earlier speech) keeps its last max_model_len // 2 - 1 tokens (31 of
    the tiny model's 64 positions; whisper-1 keeps 224 of 448): the request runs."""
    tokenizer = llm.get_tokenizer()
    prompt = " ".join(f"word{k}" for k in range(60))
    ids = tokenizer.encode(" " + prompt, add_special_tokens=False)
    assert len(ids) > 31
    got = oai.audio.transcriptions.create(model=served_model, file=("clip.wav", WAV), language="en", prompt=prompt,
                                          **FORM)
    assert got.text == offline(llm, WAV, language="en", task="transcribe", prompt=tokenizer.decode(ids[-31:]))


def test_the_worker_takes_as_many_jobs_as_its_audio_slots_fit(live_worker: str) -> None:
    """Two requests' audio fit its cache (--kv-cache-memory-gb): it says it runs two at once,
    not max_num_seqs, and the API's long uploads (two pieces) still come whole (above)."""
    conn = redis.Redis.from_url(live_worker)
    assert decode_worker_info(conn.hgetall(Keys().worker(WORKER)), WORKER).max_num_seqs == 2
    conn.close()


def test_a_language_the_model_lacks_is_a_400(oai: openai.OpenAI, served_model: str) -> None:
    with pytest.raises(openai.BadRequestError, match="language 'ja' is not one this model knows") as info:
        oai.audio.transcriptions.create(model=served_model, file=("clip.wav", WAV), language="ja", **FORM)
    assert info.value.body["param"] == "language"


def test_what_the_api_reads_from_a_whisper_tokenizer(tiny_whisper_dir: Path) -> None:
    """The worker's templates tell a multilingual model (languages to detect or name) from an
    English-only one (no language asked, English only taken)."""
    from transformers import AutoTokenizer

    from api.errors import APIError
    from api.transcriptions import WhisperPrompts
    from worker.models.whisper import CHAT_TEMPLATE, ENGLISH_CHAT_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(tiny_whisper_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    multilingual = WhisperPrompts.of(tokenizer)
    assert multilingual is not None and not multilingual.english_only and multilingual.tasks
    assert sorted(multilingual.languages.values()) == ["de", "en", "fr"]
    assert multilingual.first_timestamp == tokenizer.convert_tokens_to_ids("<|0.00|>")
    tokenizer.chat_template = ENGLISH_CHAT_TEMPLATE
    english = WhisperPrompts.of(tokenizer)
    assert english is not None and english.english_only and not english.languages
    english.check("en")
    with pytest.raises(APIError, match="this model transcribes English only, got language 'fr'"):
        english.check("fr")
