"""Audio clips in chat messages through a live worker serving the tiny Qwen2-Audio, driven by
the official `openai` client: OpenAI's `input_audio` parts (chat and Responses) and vLLM's
`audio_url` data URLs.
The oracle is the offline engine given the same clip (checked against transformers in
tests/worker/test_audio.py)."""

from __future__ import annotations

import base64
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from worker import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent.parent / "worker"))
from test_audio import clip, wav  # noqa: E402 (the worker tests' clips)

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
AUDIO_URL = {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{DATA}"}}


@pytest.fixture(scope="module")
def offline(tiny_qwen2_audio_dir: Path):
    """The offline engine's greedy reply to the question with the clip."""
    llm = LLM(str(tiny_qwen2_audio_dir), dtype="float32", num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return llm.chat(_messages(INPUT_AUDIO), params, use_tqdm=False)[0]


def test_chat_with_a_clip_as_input_audio_and_as_an_audio_url(oai: openai.OpenAI, served_model: str, offline) -> None:
    reply = oai.chat.completions.create(model=served_model, messages=_messages(INPUT_AUDIO), **GREEDY)
    assert reply.choices[0].message.content == offline.outputs[0].text
    assert reply.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert offline.prompt_token_ids.count(10) == 12  # half a second: 50 mel frames, 25 positions, 12 tokens
    chunks = oai.chat.completions.create(model=served_model, messages=_messages(AUDIO_URL), stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == offline.outputs[0].text


def test_the_responses_api_takes_input_audio(oai: openai.OpenAI, served_model: str, offline) -> None:
    content = [{"type": "input_text", "text": "What do you hear? "},
               {"type": "input_audio", "input_audio": {"data": DATA, "format": "wav"}}]
    response = oai.responses.create(model=served_model, input=[{"role": "user", "content": content}],
                                    max_output_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
    assert response.output_text == offline.outputs[0].text


@pytest.mark.parametrize(("part", "error", "param"), [
    ({"type": "input_audio", "input_audio": {"data": "@@@", "format": "wav"}}, "not valid base64",
     "messages[0].content[1].input_audio.data"),
    ({"type": "input_audio", "input_audio": {"data": DATA, "format": "mp3"}}, "format 'mp3' is not taken",
     "messages[0].content[1].input_audio.format"),
    ({"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}}, "must be a base64 data URL",
     "messages[0].content[1].audio_url"),
    ({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"ID3" + bytes(60)).decode()}},
     "audio 0 is mp3 audio", None),  # read by the worker
    ({"type": "input_audio", "input_audio": {"data": base64.b64encode(wav(clip(1.5, 12))).decode()}},
     "longer than the model's window of 1 s", None),
])
def test_bad_clips_are_a_400_naming_them(oai: openai.OpenAI, served_model: str, part: dict, error: str,
                                         param: str | None) -> None:
    with pytest.raises(openai.BadRequestError, match=error) as info:
        oai.chat.completions.create(model=served_model, messages=_messages(part), **GREEDY)
    assert info.value.body["param"] == param
