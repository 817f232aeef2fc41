"""OpenAI's audio endpoints on Whisper, through a live worker serving the tiny Whisper, driven
by the official `openai` client: the decoder's prompt written from the form (language, task,
prompt), the language heard where the form gives none, pieces of a long upload, whisper-1's
fallback and silence. The oracles are the offline engine's chat with Whisper's template
(checked against transformers in tests/worker/test_whisper.py) and transformers itself. The
module's API turns whisper-1's checks off (a random model's tokens are all unlikely), but for
the test of them."""

from __future__ import annotations

import base64
import json
import math
import shutil
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import redis
import torch

from api.settings import Settings
from api.transcriptions import duration_s, joined, split_wav
from producer.audio import AUDIO_RATE, read_clip, to_wav
from producer.protocol import Keys
from producer.records import decode_worker_info
from worker import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent.parent / "worker"))
from test_audio import clip, wav  # noqa: E402 (the worker tests' clips)
from test_whisper import hf_greedy  # noqa: E402

WAV = wav(clip(0.6, 31))
LONG = wav(np.concatenate([clip(0.9, 32), np.zeros(800, np.float32), clip(0.8, 33)]))  # two pieces of a 1 s window
FORM = {"extra_body": {"max_tokens": 6, "ignore_eos": True}}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SPEECH_THEN_SILENCE = wav(np.concatenate([clip(0.9, 34), np.zeros(AUDIO_RATE, np.float32)]))  # two pieces
CHECKS_OFF = {"whisper_compression_ratio_threshold": math.inf, "whisper_logprob_threshold": -math.inf}


def sot_logits(model, piece: bytes, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' decoder after <|startoftranscript|> over a piece: its hidden state and
    logits."""
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=model.config.num_mel_bins, chunk_length=1)
    features = extractor(read_clip(piece, "piece", AUDIO_RATE), sampling_rate=AUDIO_RATE, return_tensors="pt")
    with torch.inference_mode():
        encoded = model.model.encoder(features["input_features"]).last_hidden_state
        hidden = model.model.decoder(input_ids=torch.tensor([[start]]), encoder_hidden_states=encoded)
        hidden = hidden.last_hidden_state[0, -1]
        return hidden, model.proj_out(hidden)


@pytest.fixture(scope="module")
def whisper_dir(tiny_whisper_dir: Path, tmp_path_factory) -> Path:
    """The tiny Whisper, its <|nospeech|> made likely (0.82) after <|startoftranscript|> over
    SPEECH_THEN_SILENCE's silent piece, and just under the likeliest token over its first;
    and suppressed, as real checkpoints suppress it."""
    from transformers import AutoTokenizer, WhisperForConditionalGeneration

    out = tmp_path_factory.mktemp("whisper-nospeech")
    shutil.copytree(tiny_whisper_dir, out, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(out)
    start, no_speech = tokenizer.convert_tokens_to_ids(["<|startoftranscript|>", "<|nospeech|>"])
    model = WhisperForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    speech, silence = (sot_logits(model, piece, start) for piece in pieces_of(SPEECH_THEN_SILENCE))
    others = [k for k in range(model.config.vocab_size) if k != no_speech]
    targets = torch.tensor([float(speech[1][others].max()) - 1.0, float(silence[1][others].logsumexp(0)) + 1.5],
                           dtype=torch.float64)
    hidden = torch.stack([speech[0], silence[0]]).double()  # the row whose products with both are the targets
    row = hidden.T @ torch.linalg.solve(hidden @ hidden.T, targets)
    with torch.no_grad():
        model.model.decoder.embed_tokens.weight[no_speech] = row.float()
    generation = json.loads((tiny_whisper_dir / "generation_config.json").read_text())
    model.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({**generation, "suppress_tokens": [no_speech]}))
    return out


# a request's audio slot and its 4 blocks of KV cache (float32): the worker's cache holds 2.5
PER_REQUEST = 2 * 2 * 50 * 32 * 4 + 4 * (2 * 2 * 16 * 32 * 4)
WORKER = "whisper"


@pytest.fixture(scope="module")
def live_worker(stack_redis, whisper_dir: Path, run_worker, tmp_path_factory) -> Iterator[str]:
    with run_worker(stack_redis.url, whisper_dir, tmp_path_factory.mktemp("whisper-worker"),
                    ("--max-model-len", "64",  # (its decoder's positions)
                     "--kv-cache-memory-gb", str(2.5 * PER_REQUEST / 2**30)), WORKER) as url:
        yield url


@pytest.fixture(scope="module")
def api_url(live_worker: str, serve_api) -> Iterator[str]:
    with serve_api(Settings(redis_url=live_worker, request_timeout_s=60.0, audio_chunk_s=1.0, **CHECKS_OFF)) as url:
        yield url


@pytest.fixture(scope="module")
def llm(whisper_dir: Path) -> LLM:
    return LLM(str(whisper_dir), dtype="float32", num_gpu_blocks_override=64)


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


def test_word_timestamps_group_each_pieces_tokens_at_their_times(oai: openai.OpenAI, served_model: str,
                                                                  llm: LLM) -> None:
    """timestamp_granularities word: the words of every piece, each from its first token's
    time (the worker's alignment, checked against transformers in tests/worker) to the next
    token's, a piece's times after the pieces before it; punctuation stays with its word."""
    tokenizer = llm.get_tokenizer()
    first = tokenizer.convert_tokens_to_ids("<|0.00|>")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, extra_args={"token_timestamps": True})
    expected, offset = [], 0.0
    for piece in pieces_of(LONG):
        part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(piece).decode(), "format": "wav"}}
        out = llm.chat([{"role": "user", "content": [part]}], params, use_tqdm=False,
                       chat_template_kwargs={"language": "en", "task": "transcribe", "timestamps": True})[0].outputs[0]
        word: list[int] = []  # its tokens' indices
        for k, token in enumerate([*out.token_ids, first]):  # (a timestamp closes the last word)
            spelled = tokenizer.decode([token], skip_special_tokens=True)
            if word and (token >= first or spelled.startswith(" ")):
                text = tokenizer.decode([out.token_ids[i] for i in word]).strip()
                times = out.token_timestamps[word[0]], out.token_timestamps[min(k, 5)]
                expected += [(text, *(round(offset + t, 2) for t in times))]
                word = []
            if token < first and spelled:
                word.append(k)
        offset += duration_s(piece)
    got = oai.audio.transcriptions.create(model=served_model, file=("long.wav", LONG), language="en",
                                          response_format="verbose_json", timestamp_granularities=["word", "segment"],
                                          **FORM)
    assert [(w.word, w.start, w.end) for w in got.words] == expected
    assert len(expected) >= 4 and expected[-1][1] >= duration_s(pieces_of(LONG)[0])  # (both pieces have words)
    assert "".join(w.word for w in got.words) == got.text.replace(" ", "") and got.segments


def test_pieces_can_be_prompted_with_the_text_before_them(served_model: str, llm: LLM, live_worker: str,
                                                          serve_api) -> None:
    """GENQ_WHISPER_CONDITION_ON_PREVIOUS_TEXT: the pieces run one after another, the second
    prompted with the form's prompt and the first piece's text."""
    first, second = pieces_of(LONG)

    def alone(piece: bytes, **variables: str) -> str:
        part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(piece).decode(), "format": "wav"}}
        return llm.chat([{"role": "user", "content": [part]}], GREEDY, use_tqdm=False,
                        chat_template_kwargs={"language": "en", "task": "transcribe", **variables})[0].outputs[0].text

    text = alone(first, prompt="Before.")
    expected = joined([text, alone(second, prompt=joined(["Before.", text]))])
    assert expected != joined([text, alone(second, prompt="Before.")])  # (the prompt tells)
    settings = Settings(redis_url=live_worker, request_timeout_s=60.0, audio_chunk_s=1.0,
                        whisper_condition_on_previous_text=True, **CHECKS_OFF)
    with serve_api(settings) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        got = client.audio.transcriptions.create(model=served_model, file=("long.wav", LONG), language="en",
                                                 prompt="Before.", **FORM)
        client.close()
    assert got.text == expected


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


def weighed(model_dir: Path, piece: bytes, prompt: list[int], no_speech: int) -> tuple[list[int], float, float]:
    """transformers' greedy tokens over a piece (6, its rules applied, <|nospeech|> suppressed),
    their mean logprob over their count and one (whisper-1's), and how likely <|nospeech|> was
    after <|startoftranscript|> (the model's own logits)."""
    from transformers import WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    logprobs: list[float] = []
    tokens = hf_greedy(model_dir, prompt, read_clip(piece, "piece", AUDIO_RATE), max_new=6, suppressed=(no_speech,),
                       logprobs=logprobs)
    return tokens, sum(logprobs) / (len(tokens) + 1), float(sot_logits(model, piece, prompt[0])[1].softmax(0)[no_speech])


def test_segments_tell_how_whisper_weighed_their_piece(oai: openai.OpenAI, served_model: str, llm: LLM,
                                                       whisper_dir: Path) -> None:
    """Each segment's avg_logprob, compression_ratio and no_speech_prob are its piece's, as
    transformers gives them, and its temperature the one it was decoded at."""
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.convert_tokens_to_ids(["<|startoftranscript|>", "<|en|>", "<|transcribe|>"])
    first, no_speech = tokenizer.convert_tokens_to_ids(["<|0.00|>", "<|nospeech|>"])
    got = oai.audio.transcriptions.create(model=served_model, file=("a.wav", SPEECH_THEN_SILENCE), language="en",
                                          response_format="verbose_json", **FORM)
    seeks = [0, round(duration_s(pieces_of(SPEECH_THEN_SILENCE)[0]) * 100)]  # (where each piece starts, in 10 ms)
    for seek, piece in zip(seeks, pieces_of(SPEECH_THEN_SILENCE), strict=True):
        tokens, avg_logprob, no_speech_prob = weighed(whisper_dir, piece, prompt, no_speech)
        text = tokenizer.decode([t for t in tokens if t < first], skip_special_tokens=True).strip().encode()
        segments = [s for s in got.segments if s.seek == seek]
        assert segments and [t for s in segments for t in s.tokens] == [t for t in tokens if t < first]
        for segment in segments:
            assert segment.avg_logprob == pytest.approx(avg_logprob, abs=1e-4)
            assert segment.no_speech_prob == pytest.approx(no_speech_prob, rel=1e-3)
            assert (segment.compression_ratio, segment.temperature) == (len(text) / len(zlib.compress(text)), 0.0)
    assert got.segments[-1].no_speech_prob > 0.6 > got.segments[0].no_speech_prob > 0  # (both exact: above)
    # at the form's temperature, once: the reply weighed by the model's likelihood, not the hotter one sampled from
    sampled = offline_sampled(llm, WAV, SamplingParams(temperature=0.5, seed=3, max_tokens=6, ignore_eos=True))
    logprobs: list[float] = []
    hf_greedy(whisper_dir, prompt, read_clip(WAV, "clip", AUDIO_RATE), max_new=6, suppressed=(no_speech,),
              logprobs=logprobs, forced=sampled)
    hot = oai.audio.transcriptions.create(model=served_model, file=("clip.wav", WAV), language="en", temperature=0.5,
                                          response_format="verbose_json", extra_body={**FORM["extra_body"], "seed": 3})
    assert hot.segments and [t for s in hot.segments for t in s.tokens] == [t for t in sampled if t < first]
    assert {(s.temperature, round(s.avg_logprob, 4)) for s in hot.segments} == {(0.5, round(sum(logprobs) / 7, 4))}


def test_unlikely_pieces_are_decoded_hotter_and_silence_is_dropped(served_model: str, llm: LLM, whisper_dir: Path,
                                                                  live_worker: str, serve_api) -> None:
    """whisper-1's checks (the API's defaults): the speech piece's greedy tokens are unlikely
    (a random model), so it is decoded again at 0.2, 0.4, ... 1.0, where it stays (as
    unlikely each time), each time the likeliest of five samples kept; the silent piece's
    are unlikely too, but the model heard no speech: it is dropped, not decoded again."""
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.convert_tokens_to_ids(["<|startoftranscript|>", "<|en|>", "<|transcribe|>"])
    first, no_speech = tokenizer.convert_tokens_to_ids(["<|0.00|>", "<|nospeech|>"])
    speech, silence = pieces_of(SPEECH_THEN_SILENCE)
    _, avg_logprob, no_speech_prob = weighed(whisper_dir, speech, prompt, no_speech)
    assert avg_logprob < -1 and no_speech_prob < 0.6
    _, avg_logprob, no_speech_prob = weighed(whisper_dir, silence, prompt, no_speech)
    assert avg_logprob < -1 and no_speech_prob > 0.6
    samples = offline_samples(llm, speech, SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True,
                                                           n=5, logprobs=0))
    best = max(samples, key=lambda out: sum(e.logprob for e in out.logprobs) / (len(out.token_ids) + 1))
    assert len({tuple(out.token_ids) for out in samples}) > 1 and best is not samples[0]  # (a choice was made)
    with serve_api(Settings(redis_url=live_worker, request_timeout_s=60.0, audio_chunk_s=1.0)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        got = client.audio.transcriptions.create(
            model=served_model, file=("a.wav", SPEECH_THEN_SILENCE), language="en", response_format="verbose_json",
            extra_body={**FORM["extra_body"], "seed": 3})
        client.close()
    assert got.segments and {s.temperature for s in got.segments} == {1.0}
    assert all(s.avg_logprob < -1 and s.seek == 0 for s in got.segments)
    assert [t for s in got.segments for t in s.tokens] == [t for t in best.token_ids if t < first]


def test_include_logprobs_gives_each_written_tokens(oai: openai.OpenAI, served_model: str, llm: LLM,
                                                    whisper_dir: Path) -> None:
    """include logprobs (json): each written token and its logprob, transformers' (after the
    rules), whole and as the text streams."""
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.convert_tokens_to_ids(["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"])
    logprobs: list[float] = []
    tokens = hf_greedy(whisper_dir, prompt, read_clip(WAV, "clip", AUDIO_RATE), max_new=6,
                       suppressed=tuple(tokenizer.convert_tokens_to_ids(["<|nospeech|>"])), logprobs=logprobs)
    expected = [(tokenizer.decode([t]), round(lp, 4)) for t, lp in zip(tokens, logprobs, strict=True)]
    got = oai.audio.transcriptions.create(model=served_model, file=("clip.wav", WAV), language="en",
                                          include=["logprobs"], **FORM)
    assert [(lp.token, round(lp.logprob, 4)) for lp in got.logprobs] == expected
    events = list(oai.audio.transcriptions.create(model=served_model, file=("clip.wav", WAV), language="en",
                                                  include=["logprobs"], stream=True, **FORM))
    assert [(lp.token, round(lp.logprob, 4)) for e in events[:-1] for lp in e.logprobs] == expected
    assert [(lp.token, round(lp.logprob, 4)) for lp in events[-1].logprobs] == expected


def offline_sampled(llm: LLM, piece: bytes, params: SamplingParams) -> list[int]:
    """The offline engine's tokens for a piece, English, with timestamps."""
    return offline_samples(llm, piece, params)[0].token_ids


def offline_samples(llm: LLM, piece: bytes, params: SamplingParams) -> list[Any]:
    """The offline engine's completions of a piece, English, with timestamps."""
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(piece).decode(), "format": "wav"}}
    return llm.chat([{"role": "user", "content": [part]}], params, use_tqdm=False,
                    chat_template_kwargs={"language": "en", "task": "transcribe", "timestamps": True})[0].outputs


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


@pytest.mark.parametrize("language, name, text", [
    ("zh", "chinese", "你好，世界。我们今天去公园“散步”吧！"),
    ("ja", "japanese", "（今日は） “いい”天気ですね。"),
    ("en", "english", " Hello, \"dear\" world (again)! Fine."),
])
def test_words_are_openai_whispers_in_languages_written_with_and_without_spaces(
        tiny_whisper_dir: Path, language: str, name: str, text: str) -> None:
    """Word timestamps split as openai-whisper splits (transformers' port of it is the oracle):
    at spaces, or where a language is written without them at each whole character (of one
    token or several bytes' tokens); a closing mark goes with the word before, an opening one
    after a space with the word after. Each word runs from its first token's time to the next
    token's."""
    from transformers import AutoTokenizer
    from transformers.models.whisper.tokenization_whisper import _combine_tokens_into_words

    from api.transcriptions import WhisperPrompts
    from worker.model_executor.models.whisper import CHAT_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(tiny_whisper_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    whisper = WhisperPrompts.of(tokenizer)
    assert whisper is not None
    tokens = tokenizer.encode(text, add_special_tokens=False)
    times = [0.1 * k for k in range(len(tokens) + 1)]  # (the end token's last)

    class Decoding:  # what the port asks of Whisper's own tokenizer
        eos_token_id = whisper.start  # (text tokens come before it, as before Whisper's <|endoftext|>)

        def decode(self, ids: list[int], decode_with_timestamps: bool = False) -> str:
            return tokenizer.decode(ids)

    words, _, indices = _combine_tokens_into_words(Decoding(), tokens, name)
    expected = [{"word": w.strip(), "start": round(2.0 + times[i[0]], 2), "end": round(2.0 + times[i[-1] + 1], 2)}
                for w, i in zip(words, indices, strict=True)]
    assert whisper.words(tokens, times, 2.0, language) == expected
    assert len(expected) > 3 and any(len(i) > 1 for i in indices)  # (characters of several tokens, or marks)


def test_what_the_api_reads_from_a_whisper_tokenizer(tiny_whisper_dir: Path) -> None:
    """The worker's templates tell a multilingual model (languages to detect or name) from an
    English-only one (no language asked, English only taken)."""
    from transformers import AutoTokenizer

    from api.errors import APIError
    from api.transcriptions import WhisperPrompts
    from worker.model_executor.models.whisper import CHAT_TEMPLATE, ENGLISH_CHAT_TEMPLATE

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
    with pytest.raises(APIError, match="the worker sent no token timestamps"):  # (one older than the API)
        english.words([100, 101], [], 0.0)
