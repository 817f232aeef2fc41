"""Audio clips in chat messages through a live worker serving the tiny Qwen2-Audio, driven by
the official `openai` client: OpenAI's `input_audio` parts (chat and Responses) and vLLM's
`audio_url` data URLs.
The oracle is the offline engine given the same clip (checked against transformers in
tests/worker/test_audio.py)."""

from __future__ import annotations

import base64
import io
import sys
import wave
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import redis

from api.settings import Settings
from api.transcriptions import InOrder, ended_without_end, joined, split_wav
from producer.audio import read_clip, to_wav
from producer.protocol import Keys, decode_job
from worker import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent.parent / "worker"))
from test_audio import RATE, clip, flac, wav  # noqa: E402 (the worker tests' clips)

WAV = wav(clip(0.5, 11, rate=8000), rate=8000)  # half a second at 8 kHz
DATA = base64.b64encode(WAV).decode()
GREEDY = {"temperature": 0.0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def live_worker(stack_redis, tiny_qwen2_audio_dir: Path, run_worker, tmp_path_factory) -> Iterator[str]:
    with run_worker(stack_redis.url, tiny_qwen2_audio_dir, tmp_path_factory.mktemp("audio-worker")) as url:
        yield url


def _messages(part: dict) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "What do you hear? "}, part]}]


INPUT_AUDIO = {"type": "input_audio", "input_audio": {"data": DATA, "format": "wav"}}


def normalized(audio: bytes) -> bytes:
    """The clip as the API queues it: 16-bit mono WAV at 16 kHz."""
    return to_wav(read_clip(audio, "the clip", RATE), RATE)


# what the worker gets for INPUT_AUDIO: the oracle is the offline engine given that
QUEUED_AUDIO = {"type": "input_audio", "input_audio": {"data": base64.b64encode(normalized(WAV)).decode()}}
AUDIO_URL = {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{DATA}"}}


@pytest.fixture(scope="module")
def api_url(live_worker: str, serve_api) -> Iterator[str]:
    """The API in front of the live worker, cutting uploads into pieces of the tiny model's
    1 s window."""
    with serve_api(Settings(redis_url=live_worker, request_timeout_s=60.0, audio_chunk_s=1.0)) as url:
        yield url


@pytest.fixture(scope="module")
def llm(tiny_qwen2_audio_dir: Path) -> LLM:
    return LLM(str(tiny_qwen2_audio_dir), dtype="float32", num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def offline(llm: LLM):
    """The offline engine's greedy reply to the question with the clip."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return llm.chat(_messages(QUEUED_AUDIO), params, use_tqdm=False)[0]


def test_chat_with_a_clip_as_input_audio_and_as_an_audio_url(oai: openai.OpenAI, served_model: str, offline,
                                                              live_worker: str) -> None:
    reply = oai.chat.completions.create(model=served_model, messages=_messages(INPUT_AUDIO), **GREEDY)
    [(_, fields)] = redis.Redis.from_url(live_worker).xrevrange(Keys().requests, count=1)
    queued = decode_job(fields).messages[0]["content"][1]  # the 8 kHz clip, queued at 16 kHz
    assert queued["type"] == "audio" and queued["audio"] == normalized(WAV)
    with wave.open(io.BytesIO(queued["audio"])) as reader:
        assert (reader.getframerate(), reader.getnchannels(), reader.getsampwidth()) == (RATE, 1, 2)
    assert reply.choices[0].message.content == offline.outputs[0].text
    assert reply.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert offline.prompt_token_ids.count(10) == 12  # half a second: 50 mel frames, 25 positions, 12 tokens
    chunks = oai.chat.completions.create(model=served_model, messages=_messages(AUDIO_URL), stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == offline.outputs[0].text


def test_an_http_audio_url_is_fetched_by_the_api(oai: openai.OpenAI, served_model: str, offline, serve_files) -> None:
    with serve_files({"/clip.wav": (WAV, "audio/wav")}) as files:
        reply = oai.chat.completions.create(
            model=served_model, messages=_messages({"type": "audio_url", "audio_url": {"url": f"{files}/clip.wav"}}),
            **GREEDY)
        assert reply.choices[0].message.content == offline.outputs[0].text
        with pytest.raises(openai.BadRequestError, match="answered 404") as info:
            oai.chat.completions.create(
                model=served_model, messages=_messages({"type": "audio_url", "audio_url": f"{files}/missing.wav"}),
                **GREEDY)
    assert info.value.body["param"] == "messages[0].content[1].audio_url"
    from api.chat import chat_prompt
    from api.errors import APIError
    from api.request_bodies import ChatCompletionRequest

    line = ChatCompletionRequest(model="m", messages=_messages({"type": "audio_url", "audio_url": f"{files}/clip.wav"}))
    with pytest.raises(APIError, match="audio URLs are fetched for chat and Responses requests only"):
        chat_prompt(line)  # a batch line's: not fetched


def test_clips_count_against_the_images_per_request(oai: openai.OpenAI, served_model: str) -> None:
    messages = [{"role": "user", "content": [INPUT_AUDIO] * 9}]  # GENQ_MAX_IMAGES_PER_REQUEST is 8
    with pytest.raises(openai.BadRequestError, match="hold 9 images or clips, more than this server takes") as info:
        oai.chat.completions.create(model=served_model, messages=messages, **GREEDY)
    assert info.value.body["param"] == "messages"


def test_the_responses_api_takes_input_audio(oai: openai.OpenAI, served_model: str, offline) -> None:
    content = [{"type": "input_text", "text": "What do you hear? "},
               {"type": "input_audio", "input_audio": {"data": DATA, "format": "wav"}}]
    response = oai.responses.create(model=served_model, input=[{"role": "user", "content": content}],
                                    max_output_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
    assert response.output_text == offline.outputs[0].text


@pytest.mark.parametrize(("part", "error", "param"), [
    ({"type": "input_audio", "input_audio": {"data": "@@@", "format": "wav"}}, "not valid base64",
     "messages[0].content[1].input_audio.data"),
    ({"type": "input_audio", "input_audio": {"data": DATA, "format": "aac"}}, "format 'aac' is not taken",
     "messages[0].content[1].input_audio.format"),
    ({"type": "audio_url", "audio_url": {"url": "ftp://example.com/a.wav"}}, "must be a base64 data URL .* or an http",
     "messages[0].content[1].audio_url"),
    ({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"ID3" + bytes(60)).decode()}},
     "the clip is not audio that can be read", "messages[0].content[1].input_audio"),  # read by the API
    ({"type": "input_audio", "input_audio": {"data": base64.b64encode(wav(clip(1.5, 12))).decode()}},
     "longer than the model's window of 1 s", None),
])
def test_bad_clips_are_a_400_naming_them(oai: openai.OpenAI, served_model: str, part: dict, error: str,
                                         param: str | None) -> None:
    with pytest.raises(openai.BadRequestError, match=error) as info:
        oai.chat.completions.create(model=served_model, messages=_messages(part), **GREEDY)
    assert info.value.body["param"] == param


def offline_replies(llm: LLM, instruction: str, audio: bytes = WAV) -> list:
    """The offline engine's greedy replies (with logprobs) to `audio`, a piece at a time, each
    followed by `instruction`."""
    part = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    chats = [[{"role": "user", "content": [{**part, "input_audio": {"data": base64.b64encode(piece).decode()}},
                                           {"type": "text", "text": instruction}]}]
             for piece in split_wav(normalized(audio), 1.0)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    return [r.outputs[0] for r in llm.chat(chats, params, use_tqdm=False)]


def offline_reply(llm: LLM, instruction: str, audio: bytes = WAV) -> str:
    """The replies' texts joined as the API joins the pieces'."""
    return joined([r.text for r in offline_replies(llm, instruction, audio)])


TRANSCRIBE = {"model": None, "file": ("clip.wav", WAV), "extra_body": {"max_tokens": 8, "ignore_eos": True}}


def test_transcriptions_and_translations_run_as_a_chat_with_the_clip(
    oai: openai.OpenAI, served_model: str, llm: LLM
) -> None:
    """OpenAI's audio endpoints: the clip and the instruction (with the language and prompt
    given), in json, text, verbose_json and as a stream; and the translation's instruction."""
    settings = Settings()
    call = {**TRANSCRIBE, "model": served_model}
    expected = offline_reply(llm, settings.transcription_instruction)
    got = oai.audio.transcriptions.create(**call)
    assert got.text == expected and got.usage.output_tokens == 8
    flac_upload = oai.audio.transcriptions.create(**{**call, "file": ("clip.flac", flac(clip(0.5, 11, rate=8000), 8000))})
    assert flac_upload.text == expected  # the same samples, losslessly: the API decodes it into the same WAV
    assert oai.audio.transcriptions.create(**call, response_format="text") == expected
    verbose = oai.audio.transcriptions.create(**call, response_format="verbose_json", language="fr", prompt="Bonjour.")
    with_context = settings.transcription_instruction + (
        " The speech is in the language whose ISO-639-1 code is fr. Earlier speech, for context: Bonjour.")
    assert (verbose.text, verbose.language, verbose.duration) == (
        offline_reply(llm, with_context), "french", 0.5)  # (named as OpenAI names it)
    events = list(oai.audio.transcriptions.create(**call, stream=True))
    assert "".join(e.delta for e in events if e.type == "transcript.text.delta") == expected
    assert events[-1].type == "transcript.text.done" and events[-1].text == expected
    translated = oai.audio.translations.create(model=served_model, file=("clip.wav", WAV),
                                               extra_body={"max_tokens": 8, "ignore_eos": True})
    assert translated.text == offline_reply(llm, settings.translation_instruction)


def test_a_long_upload_runs_as_pieces_joined_in_order(oai: openai.OpenAI, served_model: str, llm: LLM) -> None:
    """2.3 s through a 1 s window: three pieces, three jobs, their texts joined in order, whole
    and streamed."""
    long = wav(np.concatenate([clip(0.9, 21), np.zeros(800, np.float32), clip(1.35, 22)]))
    expected = offline_reply(llm, Settings().transcription_instruction, long)
    call = {**TRANSCRIBE, "model": served_model, "file": ("long.wav", long)}
    got = oai.audio.transcriptions.create(**call)
    assert got.text == expected and got.usage.output_tokens == 3 * 8
    events = list(oai.audio.transcriptions.create(**call, stream=True))
    assert "".join(e.delta for e in events if e.type == "transcript.text.delta") == expected == events[-1].text
    # include logprobs: every written token's, in the pieces' order, whole and as the text streams
    replies = offline_replies(llm, Settings().transcription_instruction, long)
    written = [(lp.decoded[lp.token_id], round(lp.logprob, 4)) for r in replies for lp in r.logprobs]
    weighed = oai.audio.transcriptions.create(**call, include=["logprobs"], chunking_strategy="auto")
    assert [(lp.token, round(lp.logprob, 4)) for lp in weighed.logprobs] == written and weighed.text == expected
    assert all(lp.bytes == list(lp.token.encode()) for lp in weighed.logprobs)
    events = list(oai.audio.transcriptions.create(**call, include=["logprobs"], stream=True))
    streamed = [(lp.token, round(lp.logprob, 4)) for e in events[:-1] for lp in e.logprobs]
    assert streamed == [(lp.token, round(lp.logprob, 4)) for lp in events[-1].logprobs] == written


def test_pieces_are_cut_in_quiet_moments_and_streamed_in_order() -> None:
    """A cut lands in the silence before the limit; the pieces hold every frame once. Text of
    a later piece waits for the pieces before it."""
    audio = wav(np.concatenate([clip(0.72, 23), np.zeros(480, np.float32), clip(1.0, 24)]))
    pieces = split_wav(audio, 1.0)
    frames = [wave.open(io.BytesIO(p)).readframes(10**9) for p in pieces]
    assert b"".join(frames) == wave.open(io.BytesIO(audio)).readframes(10**9)
    assert 0.72 * RATE <= len(frames[0]) // 2 <= 0.75 * RATE and all(len(f) // 2 <= RATE for f in frames)
    order = InOrder(3)
    assert order.add(2, " third.", True, [{"token": "c"}]) == "" and order.add(1, " second", False, [{"token": "b"}]) == ""
    assert order.taken_logprobs() == []  # (a later piece's wait with its text)
    assert order.add(0, " first", False, [{"token": "a"}]) == "first" and order.taken_logprobs() == [{"token": "a"}]
    assert order.add(0, " one ", True) == " one second" and order.taken_logprobs() == [{"token": "b"}]
    assert order.add(1, " two", True, [{"token": "b2"}]) == " two third."
    assert order.taken_logprobs() == [{"token": "b2"}, {"token": "c"}]
    assert order.sent == joined([" first one ", " second two", " third."])
    assert ended_without_end([1, 2, 3], "stop") == [1, 2] and ended_without_end([1, 2, 3], "length") == [1, 2, 3]


@pytest.mark.parametrize(("extra", "error", "param"), [
    ({"response_format": "srt"}, "timestamps are given by Whisper models only", "response_format"),
    ({"timestamp_granularities": ["segment"], "response_format": "verbose_json"},
     "timestamps are given by Whisper models only", "timestamp_granularities"),
    ({"timestamp_granularities": ["word"], "response_format": "verbose_json"},
     "timestamps are given by Whisper models only", "timestamp_granularities"),
    ({"timestamp_granularities": ["word"]}, "word timestamps come in verbose_json", "timestamp_granularities"),
    ({"file": ("clip.mp3", b"ID3" + bytes(60))}, "the file is not audio that can be read", "file"),
    ({"include": ["logprobs"], "response_format": "text"}, "logprobs are given with response_format json only",
     "include"),
    ({"include": ["item_reference"]}, "include may hold logprobs only", "include"),
    ({"chunking_strategy": {"type": "server_vad", "threshold": 0.5}}, "chunking_strategy may be auto only",
     "chunking_strategy"),
])
def test_what_transcriptions_cannot_do_is_a_400(oai: openai.OpenAI, served_model: str, extra: dict, error: str,
                                                param: str) -> None:
    with pytest.raises(openai.BadRequestError, match=error) as info:
        oai.audio.transcriptions.create(**{**TRANSCRIBE, "model": served_model, **extra})
    assert info.value.body["param"] == param
