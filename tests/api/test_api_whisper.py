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

from api.settings import Settings
from api.transcriptions import joined, split_wav
from producer.audio import AUDIO_RATE, read_clip, to_wav
from worker import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent.parent / "worker"))
from test_audio import clip, wav  # noqa: E402 (the worker tests' clips)

WAV = wav(clip(0.6, 31))
LONG = wav(np.concatenate([clip(0.9, 32), np.zeros(800, np.float32), clip(0.8, 33)]))  # two pieces of a 1 s window
FORM = {"extra_body": {"max_tokens": 6, "ignore_eos": True}}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def live_worker(stack_redis, tiny_whisper_dir: Path, run_worker, tmp_path_factory) -> Iterator[str]:
    with run_worker(stack_redis.url, tiny_whisper_dir, tmp_path_factory.mktemp("whisper-worker"),
                    ("--max-model-len", "64")) as url:  # (its decoder's positions)
        yield url


@pytest.fixture(scope="module")
def api_url(live_worker: str, serve_api) -> Iterator[str]:
    with serve_api(Settings(redis_url=live_worker, request_timeout_s=60.0, audio_chunk_s=1.0)) as url:
        yield url


@pytest.fixture(scope="module")
def llm(tiny_whisper_dir: Path) -> LLM:
    return LLM(str(tiny_whisper_dir), dtype="float32", num_gpu_blocks_override=64)


def offline(llm: LLM, audio: bytes, **variables: str) -> str:
    """The offline engine's text for each piece of `audio` under Whisper's template, joined."""
    pieces = split_wav(to_wav(read_clip(audio, "clip", AUDIO_RATE), AUDIO_RATE), 1.0)
    chats = [[{"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": base64.b64encode(piece).decode(), "format": "wav"}}]}] for piece in pieces]
    replies = llm.chat(chats, GREEDY, use_tqdm=False, chat_template_kwargs=variables)
    return joined([r.outputs[0].text for r in replies])


def heard(llm: LLM, audio: bytes) -> str:
    """The language the offline engine hears in the first piece: its one token among the
    language tokens."""
    audio = split_wav(to_wav(read_clip(audio, "clip", AUDIO_RATE), AUDIO_RATE), 1.0)[0]
    tokenizer = llm.get_tokenizer()
    ids = {tokenizer.convert_tokens_to_ids(f"<|{code}|>"): code for code in ("en", "fr", "de")}
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(audio).decode(), "format": "wav"}}
    params = SamplingParams(temperature=0.0, max_tokens=1, allowed_token_ids=sorted(ids))
    out = llm.chat([{"role": "user", "content": [part]}], params, use_tqdm=False,
                   chat_template_kwargs={"detect_language": True})[0]
    return ids[out.outputs[0].token_ids[0]]


def test_a_transcription_writes_whispers_prompt_from_the_form(oai: openai.OpenAI, served_model: str, llm: LLM) -> None:
    verbose = oai.audio.transcriptions.create(model=served_model, file=("clip.wav", WAV), language="de",
                                              prompt="Vorher.", response_format="verbose_json", **FORM)
    assert verbose.text == offline(llm, WAV, language="de", task="transcribe", prompt="Vorher.")
    assert (verbose.language, verbose.duration) == ("german", 0.6)
    translated = oai.audio.translations.create(model=served_model, file=("clip.wav", WAV), **FORM)
    language = heard(llm, WAV)
    assert translated.text == offline(llm, WAV, language=language, task="translate")


def test_without_a_language_the_one_heard_is_used(oai: openai.OpenAI, served_model: str, llm: LLM) -> None:
    """A long upload: the language heard in its first piece, then a job per piece."""
    language = heard(llm, LONG)
    expected = offline(llm, LONG, language=language, task="transcribe")
    verbose = oai.audio.transcriptions.create(model=served_model, file=("long.wav", LONG),
                                              response_format="verbose_json", **FORM)
    assert (verbose.text, verbose.usage.output_tokens) == (expected, 2 * 6)
    assert verbose.language == {"en": "english", "fr": "french", "de": "german"}[language]
    events = list(oai.audio.transcriptions.create(model=served_model, file=("long.wav", LONG), stream=True, **FORM))
    assert events[-1].type == "transcript.text.done" and events[-1].text == expected


def test_a_language_the_model_lacks_is_a_400(oai: openai.OpenAI, served_model: str) -> None:
    with pytest.raises(openai.BadRequestError, match="language 'ja' is not one this model knows") as info:
        oai.audio.transcriptions.create(model=served_model, file=("clip.wav", WAV), language="ja", **FORM)
    assert info.value.body["param"] == "language"
