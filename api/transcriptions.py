"""OpenAI's audio endpoints, `/v1/audio/transcriptions` and `/v1/audio/translations`, for models
that take audio clips (worker.core.multimodal). Each runs as a chat whose user message holds the
uploaded clip. For Whisper (a model whose tokenizer has `<|startoftranscript|>`) the worker's
template writes the decoder's prompt from the chat's template variables: the language (the
form's, else the one the model hears: a one-token job first, limited to the language tokens),
the task and the prompt. For the others (Qwen2-Audio) an instruction follows the clip
(GENQ_TRANSCRIPTION_INSTRUCTION, GENQ_TRANSLATION_INSTRUCTION), the language and prompt given
added to it, as gpt-4o-transcribe takes them. The reply is the text. A long upload is cut into
pieces of the model's window (GENQ_AUDIO_CHUNK_S), each a job, their texts joined in order.

Whisper decodes as whisper-1 does (OpenAI's transcribe): at temperature 0 a piece whose text
repeats itself or whose tokens were unlikely is decoded again, hotter (FALLBACK_TEMPERATURES),
the likeliest of FALLBACK_BEST_OF samples kept, and one the model hears as silence is dropped
(Settings' whisper_* thresholds); each segment tells its piece's temperature, avg_logprob,
compression_ratio and no_speech_prob.

Formats: `json` ({"text", "usage"}), `text`, and `verbose_json` ({"task", "language",
"duration", "text", "usage"}, and on Whisper its `segments`); `srt`, `vtt` and
`timestamp_granularities: ["segment"]` need timestamps, which Whisper gives (its prompt without
<|notimestamps|>: segments between timestamp tokens, each piece's offset added) and other
models do not (a 400 says so). `timestamp_granularities: ["word"]` (verbose_json) adds
`words`, from the times the worker finds for each token (worker.model_executor.models.whisper's
token_timestamps). `stream: true` sends OpenAI's
`transcript.text.delta` events and a `transcript.text.done`. `include: ["logprobs"]` (with
`json`, as OpenAI's) adds each written token's logprob to the reply, and to a stream's events.
"""

from __future__ import annotations

import base64
import functools
import io
import math
import wave
import zlib
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import ValidationError
from starlette.datastructures import FormData

from api.errors import APIError, invalid_param
from api.generate import Collector, StreamError, relayed_chunks
from api.logprobs import TokenLogprob, top_token_pairs
from api.render import ChatRenderer, Choice, RelayedRequest
from api.request_bodies import ChatCompletionRequest, ChatMessage, ContentPart
from api.response_bodies import Usage
from api.settings import Settings
from api.sse import DONE, format_sse
from producer.audio import AUDIO_RATE, read_clip, to_wav

FORMATS = ("json", "text", "verbose_json")
TIMESTAMPED = ("srt", "vtt")
TIMESTAMP_S = 0.02  # between Whisper's timestamp tokens (its 30 s window over 1500 positions)
WHISPER_POSITIONS = 448  # its decoder's (max_target_positions), where the workers do not say
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # whisper-1's, from temperature 0
FALLBACK_BEST_OF = 5  # a hotter round's samples per piece, the likeliest kept (openai-whisper's best_of)
NO_SPEECH_TOP = 20  # the prompt's alternatives asked for: <|nospeech|> below them counts as 0
PROMPT_RESET_TEMPERATURE = 0.5  # a piece decoded hotter prompts the next with nothing (openai-whisper's)
UNSPACED = frozenset({"zh", "ja", "th", "lo", "my", "yue"})  # written without spaces: a word is a character
OPENING_MARKS = frozenset("\"'“¡¿([{-")  # word timestamps: with the word after, after a space (openai-whisper's)
CLOSING_MARKS = frozenset("\"'.。,，!！?？:：”)]}、")  # ... with the word before


# sampling fields a form may add (as vLLM's transcription requests take them), passed to the chat
SAMPLING_FIELDS = ("max_completion_tokens", "max_tokens", "seed", "top_p", "top_k", "min_p", "ignore_eos",
                   "repetition_penalty", "presence_penalty", "frequency_penalty")
FORM_FIELDS = {"transcribe": ("file", "model", "language", "prompt", "response_format", "temperature", "stream",
                              "timestamp_granularities[]", "include[]", "chunking_strategy"),
               "translate": ("file", "model", "prompt", "response_format", "temperature")}


@dataclass(frozen=True)
class AudioRequest:
    """A transcription's or translation's form fields."""

    task: str  # "transcribe" | "translate"
    audio: bytes  # the upload as 16-bit mono WAV at 16 kHz (as_wav)
    model: str
    language: str | None = None
    prompt: str | None = None
    response_format: str = "json"
    temperature: float = 0.0
    stream: bool = False
    granularities: tuple[str, ...] = ()  # timestamp_granularities[] given
    sampling: dict[str, Any] = field(default_factory=dict)  # SAMPLING_FIELDS given, as sent
    logprobs: bool = False  # include[]: ["logprobs"]

    @classmethod
    async def from_form(cls, task: str, form: FormData, max_bytes: int) -> AudioRequest:
        """The request a multipart form makes; 400 naming a missing, unknown or too large field."""
        chunking = [name for name in form if name.startswith("chunking_strategy")]
        if any(name != "chunking_strategy" or form[name] != "auto" for name in chunking) and task == "transcribe":
            raise invalid_param("chunking_strategy", "chunking_strategy may be auto only: genq cuts a long upload "
                                "at its quietest moments (server_vad's settings are not taken)")
        unknown = sorted(set(form) - set(FORM_FIELDS[task]) - set(SAMPLING_FIELDS))
        if unknown:
            raise invalid_param(unknown[0], f"{unknown[0]!r} is not a field of this endpoint")
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise invalid_param("file", "the audio file is missing (a multipart field 'file')")
        audio = await upload.read(max_bytes + 1)
        if len(audio) > max_bytes:
            raise APIError(413, f"The file is over the limit of {max_bytes} bytes (GENQ_MAX_AUDIO_BYTES).",
                           param="file", code="file_too_large")
        include = [str(i) for i in form.getlist("include[]")]
        if any(i != "logprobs" for i in include):
            raise invalid_param("include", f"include may hold logprobs only, got {include}")
        audio = as_wav(audio)
        text = {k: v for k, v in form.items() if isinstance(v, str)}
        if not text.get("model"):
            raise invalid_param("model", "model is required")
        try:
            temperature = float(text.get("temperature", 0.0))
        except ValueError:
            raise invalid_param("temperature", f"temperature must be a number, got {text['temperature']!r}") from None
        return cls(task, audio, text["model"], text.get("language"), text.get("prompt"),
                   text.get("response_format", "json"), temperature, text.get("stream", "false").lower() == "true",
                   tuple(str(g) for g in form.getlist("timestamp_granularities[]")),
                   {k: v for k, v in text.items() if k in SAMPLING_FIELDS}, bool(include))

    def check(self, whisper: WhisperPrompts | None = None) -> None:
        """400 naming the field genq cannot serve (timestamps but on a Whisper that writes them)."""
        timed = whisper is not None and whisper.first_timestamp is not None
        if "word" in self.granularities and self.response_format != "verbose_json":
            raise invalid_param("timestamp_granularities", "word timestamps come in verbose_json: ask for it")
        if (self.response_format in TIMESTAMPED or self.granularities) and not timed:
            field = "response_format" if self.response_format in TIMESTAMPED else "timestamp_granularities"
            raise invalid_param(field, "timestamps are given by Whisper models only: ask this one for json, text "
                                "or verbose_json")
        if self.response_format not in (*FORMATS, *TIMESTAMPED):
            raise invalid_param("response_format", f"response_format must be one of {', '.join(FORMATS + TIMESTAMPED)}, "
                                f"got {self.response_format!r}")
        if self.stream and self.response_format not in ("json", "text"):
            raise invalid_param("stream", "a stream sends text events: ask for json or text")
        if self.logprobs and self.response_format != "json":
            raise invalid_param("include", "logprobs are given with response_format json only (as OpenAI gives them)")

    def timed(self, whisper: WhisperPrompts | None) -> bool:
        """Whether the reply is read as timed segments: Whisper's verbose_json, srt and vtt."""
        return (whisper is not None and whisper.first_timestamp is not None
                and (self.response_format in ("verbose_json", *TIMESTAMPED) or bool(self.granularities)))

    def as_chats(self, pieces: list[bytes], settings: Settings, whisper: WhisperPrompts | None = None,
                 language: str | None = None, temperature: float | None = None,
                 no_speech: bool = False, n: int = 1) -> list[ChatCompletionRequest]:
        """The chats that do the work, one per piece (split_wav's, of at most
        GENQ_AUDIO_CHUNK_S; each run as a job of its own, on any worker), at `temperature`
        (the form's where None): for Whisper, the piece and the prompt's variables
        (`language`: the one heard, where the form gives none), and outside a stream the
        logprobs its decode is weighed by (and with `no_speech` the prompt's, which tell how
        likely <|nospeech|> was), `n` decodes of each; else the piece, then the instruction."""
        temperature = self.temperature if temperature is None else temperature
        if whisper is None:
            return [self._chat([_clip(piece), ContentPart(type="text", text=self._instruction(settings))], temperature,
                               logprobs=self.logprobs) for piece in pieces]
        variables = {"language": language, "task": self.task if whisper.tasks else None,
                     "prompt": whisper.context(self.prompt) if self.prompt else None, "timestamps": self.timed(whisper)}
        kwargs = {k: v for k, v in variables.items() if v}
        weighed: dict[str, Any] = {"logprobs": True} if self.logprobs or not self.stream else {}
        if no_speech and whisper.no_speech is not None and not self.stream:
            weighed["prompt_logprobs"] = NO_SPEECH_TOP
        if "word" in self.granularities:  # (each token's time in the piece: the worker's alignment)
            weighed["vllm_xargs"] = {"token_timestamps": True}
        return [self._chat([_clip(piece)], temperature, chat_template_kwargs=kwargs,
                           return_token_ids=self.timed(whisper) or None, n=n, **weighed) for piece in pieces]

    def detecting_chat(self, whisper: WhisperPrompts, first: bytes) -> ChatCompletionRequest:
        """A Whisper chat whose one token is the language the model hears in the first piece."""
        return ChatCompletionRequest(model=self.model, messages=[ChatMessage(role="user", content=[_clip(first)])],
                                     max_tokens=1, temperature=0.0, allowed_token_ids=sorted(whisper.languages),
                                     chat_template_kwargs={"detect_language": True}, return_token_ids=True)

    def _instruction(self, settings: Settings) -> str:
        instruction = settings.transcription_instruction if self.task == "transcribe" else settings.translation_instruction
        if self.language:
            instruction += f" The speech is in the language whose ISO-639-1 code is {self.language}."
        if self.prompt:
            instruction += f" Earlier speech, for context: {self.prompt}"
        return instruction

    def _chat(self, content: list[ContentPart], temperature: float, **fields: Any) -> ChatCompletionRequest:
        try:
            return ChatCompletionRequest(model=self.model, messages=[ChatMessage(role="user", content=content)],
                                         temperature=temperature, stream=self.stream, **self.sampling, **fields)
        except ValidationError as e:
            where = str(e.errors()[0]["loc"][0])
            raise invalid_param(where, f"{where}: {e.errors()[0]['msg']}") from None


def _clip(audio: bytes) -> ContentPart:
    return ContentPart(type="input_audio", input_audio={"data": base64.b64encode(audio).decode(), "format": "wav"})


@functools.cache
def languages() -> dict[str, str]:
    """Whisper's languages, code -> name ("en" -> "english"): transformers' table, imported
    when first asked (the API loads transformers with a model's tokenizer, not before)."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return dict(LANGUAGES)


@dataclass(frozen=True)
class WhisperPrompts:
    """What a Whisper model's tokenizer says of its prompts: its language tokens (id -> code),
    whether it has task tokens (an English-only model has neither), and its first timestamp's
    id (<|0.00|>, the one after <|notimestamps|>; None without timestamps)."""

    languages: dict[int, str]
    tasks: bool
    first_timestamp: int | None = None
    tokenizer: Any = field(default=None, compare=False)
    english_only: bool = False  # its template writes no language (whisper-*.en)
    max_context: int = WHISPER_POSITIONS // 2 - 1  # of a `prompt`, the last tokens kept (as Whisper keeps them)
    start: int | None = None  # <|startoftranscript|>
    no_speech: int | None = None  # <|nospeech|> (<|nocaptions|> before large-v3)

    @classmethod
    def of(cls, tokenizer: Any, max_model_len: int | None = None) -> WhisperPrompts | None:
        """None for a tokenizer that is not Whisper's; `max_model_len`: the workers' (its
        decoder's positions, 448), half of which a prompt's context may take."""
        vocab = tokenizer.get_vocab()
        if "<|startoftranscript|>" not in vocab:
            return None
        first = vocab.get("<|0.00|>")
        timestamps = first if first == vocab.get("<|notimestamps|>", -2) + 1 else None
        marks = {"max_context": (max_model_len or WHISPER_POSITIONS) // 2 - 1, "start": vocab["<|startoftranscript|>"],
                 "no_speech": vocab.get("<|nospeech|>", vocab.get("<|nocaptions|>"))}
        if "{{ language }}" not in (getattr(tokenizer, "chat_template", None) or ""):  # the worker's English-only one
            return cls({}, False, timestamps, tokenizer, english_only=True, **marks)
        known = languages()
        languages_of = {i: token[2:-2] for token, i in vocab.items()
                        if token.startswith("<|") and token.endswith("|>") and token[2:-2] in known}
        return cls(languages_of, "<|transcribe|>" in vocab, timestamps, tokenizer, **marks)

    def context(self, prompt: str) -> str:
        """A form's `prompt` (earlier speech) as the template writes it after <|startofprev|>:
        its last max_context tokens, as Whisper keeps them (whisper-1 reads the last 224)."""
        ids = self.tokenizer.encode(" " + prompt.strip(), add_special_tokens=False)
        return prompt if len(ids) <= self.max_context else self.tokenizer.decode(ids[-self.max_context:])

    def decoded(self, choice: Choice, temperature: float, no_speech_prob: float) -> Decoded:
        """A piece's reply (a choice with its logprobs) as whisper-1 weighs it: the mean
        logprob of its tokens, the end's included, over their count and one (OpenAI's
        transcribe), and its text's compression ratio."""
        tokens = ended_without_end(list(choice.token_ids), choice.finish_reason)
        total = sum(lp.logprob or 0.0 for lp in choice.logprobs)
        words = [t for t in tokens if self.first_timestamp is None or t < self.first_timestamp]
        text = self.tokenizer.decode(words, skip_special_tokens=True)
        return Decoded(tokens, text, temperature, total / (len(tokens) + 1), compression_ratio(text.strip()),
                       no_speech_prob, choice.logprobs[: len(tokens)], choice.token_timestamps or [])

    def words(self, tokens: list[int], times: list[float], offset_s: float,
              language: str | None = None) -> list[dict[str, Any]]:
        """A piece's reply as OpenAI's words, each `{"word", "start", "end"}`: its text tokens
        (timestamps and special tokens left out) grouped at those that begin with a space (so
        punctuation stays with the word before), or in a language written without spaces
        (UNSPACED) wherever the tokens so far spell whole characters, a closing mark then
        joining the word before, an opening one after a space the word after (openai-whisper's
        rules); each word from its first token's time to the time of the token after it (the
        next word's, a timestamp's, or the end's), counted from `offset_s`; `times`: each
        token's, the end token's last (the worker's)."""
        if len(times) < len(tokens):  # (a worker older than the API's words)
            raise APIError(500, "the worker sent no token timestamps for word timestamps: upgrade the workers",
                           type="server_error", code="job_failed")
        unspaced = language in UNSPACED
        words: list[list[int]] = []  # each word's token indices
        cut = True  # (a timestamp or special token ends the word before it)
        for k, token in enumerate(tokens):
            spelled = self.tokenizer.decode([token], skip_special_tokens=True)
            if (self.first_timestamp is not None and token >= self.first_timestamp) or not spelled:
                cut = True
            elif cut or spelled.startswith(" ") or unspaced and "\ufffd" not in self._spelled(tokens, words[-1]):
                words.append([k])
                cut = False
            else:
                words[-1].append(k)
        if unspaced:
            words = self._marks_joined(tokens, words)
        out = []
        for word in words:
            text = self._spelled(tokens, word).strip()
            end = times[min(word[-1] + 1, len(times) - 1)]
            if text:
                out.append({"word": text, "start": round(offset_s + times[word[0]], 2), "end": round(offset_s + end, 2)})
        return out

    def _spelled(self, tokens: list[int], indices: list[int]) -> str:
        return self.tokenizer.decode([tokens[i] for i in indices], skip_special_tokens=True)

    def _marks_joined(self, tokens: list[int], words: list[list[int]]) -> list[list[int]]:
        """`words` with each closing mark joined to the word just before it, and each opening
        mark after a space to the word just after it."""
        joined: list[list[int]] = []
        for word in words:
            text = self._spelled(tokens, word)
            if joined and text.strip() in CLOSING_MARKS and joined[-1][-1] + 1 == word[0]:
                joined[-1] = joined[-1] + word
            else:
                joined.append(word)
        out: list[list[int]] = []
        for word in reversed(joined):
            text = self._spelled(tokens, word)
            if out and text.startswith(" ") and text.strip() in OPENING_MARKS and word[-1] + 1 == out[-1][0]:
                out[-1] = word + out[-1]
            else:
                out.append(word)
        return out[::-1]

    def no_speech_prob(self, prompt_logprobs: list[Any] | None) -> float:
        """How likely <|nospeech|> was after <|startoftranscript|> (OpenAI's no_speech_prob),
        from a prompt's logprobs as the worker sent them; 0 where it was not among their
        NO_SPEECH_TOP alternatives there."""
        ids = [entry.get("token_id") if isinstance(entry, dict) else None for entry in prompt_logprobs or []]
        if self.no_speech is None or self.start not in ids[:-1]:
            return 0.0
        after = prompt_logprobs[ids.index(self.start) + 1]  # type: ignore[index]
        pairs = dict(top_token_pairs(after.get("top_logprobs")))
        if after.get("logprob") is not None:
            pairs[after["token_id"]] = after["logprob"]
        return math.exp(pairs[self.no_speech]) if self.no_speech in pairs else 0.0

    def segments(self, tokens: list[int], offset_s: float, first_id: int = 0) -> list[dict[str, Any]]:
        """A piece's reply as segments, each the text between two timestamps, times counted
        from `offset_s` (where the piece starts), ids from `first_id`. Text before the first
        timestamp starts where the segment before ended (or the piece starts); text after the
        last one, cut short, ends where it starts."""
        assert self.first_timestamp is not None
        out: list[dict[str, Any]] = []
        start: float | None = None
        text: list[int] = []

        def close(end: float) -> None:
            nonlocal text
            words = self.tokenizer.decode(text, skip_special_tokens=True)
            if words.strip():
                begin = start if start is not None else (out[-1]["end"] if out else offset_s)
                out.append({"id": first_id + len(out), "seek": round(offset_s * 100), "start": round(begin, 2),
                            "end": round(max(end, begin), 2), "text": words, "tokens": list(text)})
            text = []

        for token in tokens:
            if token < self.first_timestamp:
                text.append(token)
                continue
            time = offset_s + (token - self.first_timestamp) * TIMESTAMP_S
            if start is None and not text:
                start = time
            else:
                close(time)
                start = None
        if text:
            close(start if start is not None else (out[-1]["end"] if out else offset_s))
        return out

    def check(self, language: str | None) -> None:
        """400 naming `language` where the model has no token for it (or, English-only, it is
        not English)."""
        if self.english_only and language not in (None, "en"):
            raise invalid_param("language", f"this model transcribes English only, got language {language!r}")
        if not self.english_only and language is not None and language not in self.languages.values():
            raise invalid_param("language", f"language {language!r} is not one this model knows (ISO-639-1 codes: "
                                f"{', '.join(sorted(self.languages.values())[:12])}, ...)")


CUT_SEARCH_S = 1.0  # a long clip is cut at the quietest moment of the last second before the limit (half a piece at most)
CUT_FRAME_S = 0.02  # ... measured in frames of 20 ms


def split_wav(audio: bytes, chunk_s: float) -> list[bytes]:
    """A 16-bit mono WAV (as_wav's) cut into WAVs of at most `chunk_s` seconds (the model's
    window), each cut at the quietest 20 ms of the second before its limit, so that few words
    are cut through; the file itself when it is short enough."""
    with wave.open(io.BytesIO(audio)) as reader:
        rate = reader.getframerate()
        samples = np.frombuffer(reader.readframes(reader.getnframes()), dtype="<i2")
    limit = int(chunk_s * rate)
    if len(samples) <= limit:
        return [audio]
    loudness = np.square(samples.astype(np.float64))
    step, search = max(1, int(CUT_FRAME_S * rate)), min(int(CUT_SEARCH_S * rate), limit // 2)
    cuts, start = [], 0
    while len(samples) - start > limit:
        end = start + limit
        first = max(start + 1, end - search)  # the quietest step-long stretch in the last `search` frames
        energy = [float(loudness[at : at + step].sum()) for at in range(first, end - step + 1, step)]
        if energy:
            end = first + step * min(range(len(energy)), key=energy.__getitem__) + step // 2
        cuts.append((start, end))
        start = end
    cuts.append((start, len(samples)))
    return [to_wav(samples[a:b] / 2**15, rate) for a, b in cuts]


def as_wav(audio: bytes) -> bytes:
    """An uploaded file (WAV, MP3, FLAC, OGG, ...) as the 16-bit mono WAV at 16 kHz the pieces
    are cut from and the jobs carry (producer.audio); 400 naming `file` when it is no audio."""
    try:
        return to_wav(read_clip(audio, "the file", AUDIO_RATE), AUDIO_RATE)
    except ValueError as e:
        raise invalid_param("file", str(e)) from None


def duration_s(audio: bytes) -> float:
    """A WAV's length in seconds."""
    with wave.open(io.BytesIO(audio)) as reader:
        return reader.getnframes() / reader.getframerate()


def usage_of(usage: Usage | None, seconds: float | None = None) -> dict[str, Any]:
    """OpenAI's usage of a transcription: tokens (gpt-4o-transcribe's), or where `seconds`
    are given the audio's length, rounded up to a whole second (whisper-1's, which is billed
    by it)."""
    if seconds is not None:
        return {"type": "duration", "seconds": math.ceil(seconds)}
    assert usage is not None
    return {"type": "tokens", "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens}


def joined(texts: list[str]) -> str:
    """The pieces' texts as one: each without its edges' spaces, one space between."""
    return " ".join(t.strip() for t in texts if t.strip())


def response(audio: AudioRequest, text: str, usage: Usage | None, language: str | None = None,
             segments: list[dict[str, Any]] | None = None, logprobs: list[dict[str, Any]] | None = None,
             words: list[dict[str, Any]] | None = None) -> dict[str, Any] | str:
    """The body in the format asked: a str for `text`, `srt` and `vtt`. `language`: the code
    of the one the model heard (Whisper), named in verbose_json as OpenAI names it
    ("english"); `segments`: the timed segments, where the model gave them; `usage`: the
    tokens', or None for seconds of audio (Whisper's, as whisper-1's); `logprobs`:
    written_logprobs', with include logprobs (json only)."""
    if audio.response_format == "text":
        return text
    if audio.response_format in TIMESTAMPED:
        return subtitles(segments or [], audio.response_format)
    used = usage_of(usage, duration_s(audio.audio) if usage is None else None)
    if audio.response_format == "verbose_json":
        language = language or audio.language
        body = {"task": audio.task, "language": languages().get(language, language) if language else "unknown",
                "duration": duration_s(audio.audio), "text": text}
        return {**body, **({"segments": segments} if segments is not None else {}),
                **({"words": words} if words is not None else {}), "usage": used}
    return {"text": text, **({"logprobs": logprobs} if audio.logprobs else {}), "usage": used}


@dataclass(frozen=True)
class Decoded:
    """A piece's reply as whisper-1 weighs it (WhisperPrompts.decoded): its tokens (without
    the end), text, the temperature it was sampled at, and what decides whether it is decoded
    again or dropped as silence."""

    token_ids: list[int]
    text: str
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    logprobs: list[TokenLogprob] = field(default_factory=list)  # its tokens', as the worker sent them
    times: list[float] = field(default_factory=list)  # where each token was said (asked for word timestamps)

    def silent(self, settings: Settings) -> bool:
        """The model heard no speech, and wrote what it hardly believed."""
        return (self.no_speech_prob > settings.whisper_no_speech_threshold
                and self.avg_logprob < settings.whisper_logprob_threshold)

    def needs_fallback(self, settings: Settings) -> bool:
        """Its text repeats itself, or its tokens were unlikely (unless it is silence: decoded
        again, it would be no better)."""
        if self.no_speech_prob > settings.whisper_no_speech_threshold:
            return False
        return (self.compression_ratio > settings.whisper_compression_ratio_threshold
                or self.avg_logprob < settings.whisper_logprob_threshold)

    @property
    def weights(self) -> dict[str, float]:
        """What each of its segments tells (OpenAI's fields)."""
        return {"temperature": self.temperature, "avg_logprob": self.avg_logprob,
                "compression_ratio": self.compression_ratio, "no_speech_prob": self.no_speech_prob}


def written_logprobs(logprobs: list[TokenLogprob] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's transcription logprobs: each written token, its logprob and its bytes (from
    TokenLogprobs, or a chat's logprobs content)."""
    entries = [(lp.token, lp.logprob) if isinstance(lp, TokenLogprob) else (lp["token"], lp["logprob"])
               for lp in logprobs]
    return [{"token": token, "logprob": logprob, "bytes": list(token.encode())} for token, logprob in entries]


def ended_without_end(items: list[Any], finish_reason: str | None) -> list[Any]:
    """A reply's tokens (or their logprobs) without its end token's (a transcription's chats
    stop at an end token only, never at a stop string)."""
    return items[:-1] if finish_reason == "stop" else items


def compression_ratio(text: str) -> float:
    """How much zlib shrinks a text: over 2.4, Whisper's transcribe calls it repetitive."""
    data = text.encode()
    return len(data) / len(zlib.compress(data))


class ChoicesOnly(ChatRenderer):
    """A chat renderer whose response is the choices as collected (their logprobs, token ids
    and prompt logprobs), for the API's own reading."""

    def response(self, req: RelayedRequest, choices: list[Choice], usage: Usage) -> list[Choice]:  # type: ignore[override]
        return choices


def heard(pieces: list[bytes], replies: list[Decoded], settings: Settings) -> Iterator[tuple[Decoded, float]]:
    """The replies of the pieces the model heard speech in, each with where its piece starts
    in the upload (seconds)."""
    offset = 0.0
    for piece, reply in zip(pieces, replies, strict=True):
        if not reply.silent(settings):
            yield reply, offset
        offset += duration_s(piece)


def timed_segments(whisper: WhisperPrompts, pieces: list[bytes], replies: list[Decoded],
                   settings: Settings) -> list[dict[str, Any]]:
    """The segments of every piece's reply, in order, each piece's times from where it
    starts in the upload, each with what its piece's decode was weighed by; a silent piece's
    none."""
    out: list[dict[str, Any]] = []
    for reply, offset in heard(pieces, replies, settings):
        out += [{**segment, **reply.weights} for segment in whisper.segments(reply.token_ids, offset, len(out))]
    return out


def timed_words(whisper: WhisperPrompts, pieces: list[bytes], replies: list[Decoded],
                settings: Settings, language: str | None = None) -> list[dict[str, Any]]:
    """The words of every piece's reply, in order, each piece's times from where it starts
    in the upload; a silent piece's none. `language`: the code the speech is in."""
    return [word for reply, offset in heard(pieces, replies, settings)
            for word in whisper.words(reply.token_ids, reply.times, offset, language)]


def subtitles(segments: list[dict[str, Any]], kind: str) -> str:
    """The segments as SubRip (`srt`) or WebVTT (`vtt`) cues."""
    def stamp(seconds: float) -> str:
        ms = round(seconds * 1000)
        text = f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}"
        return f"{text},{ms % 1000:03d}" if kind == "srt" else f"{text}.{ms % 1000:03d}"

    cues = [f"{stamp(s['start'])} --> {stamp(s['end'])}\n{s['text'].strip()}\n" for s in segments]
    if kind == "srt":
        return "\n".join(f"{k}\n{cue}" for k, cue in enumerate(cues, 1))
    return "WEBVTT\n\n" + "\n".join(cues)


class InOrder:
    """The pieces' texts as one stream, in order: a piece's text goes out as it comes once
    the pieces before it have ended, else when they have; what joined() would write."""

    def __init__(self, num_pieces: int) -> None:
        self.texts = [""] * num_pieces
        self.ended = [False] * num_pieces
        self.sent = ""  # of joined(), what went out
        self.logprobs: list[list[dict[str, Any]]] = [[] for _ in range(num_pieces)]  # each piece's tokens'
        self.logprobs_sent = [0] * num_pieces
        self.running = 0  # the first piece not ended

    def add(self, piece: int, delta: str, ended: bool, logprobs: list[dict[str, Any]] | None = None) -> str:
        """What goes out now (and its pieces' logprobs: taken_logprobs)."""
        self.texts[piece] += delta
        self.logprobs[piece] += logprobs or []
        self.ended[piece] = self.ended[piece] or ended
        self.running = next((k for k, done in enumerate(self.ended) if not done), len(self.texts))
        now = joined(self.texts[: self.running + 1])  # (each piece's stripped text only grows at its end)
        new, self.sent = now[len(self.sent):], now
        return new

    def taken_logprobs(self) -> list[dict[str, Any]]:
        """The logprobs of the pieces whose text has gone out, not taken before."""
        out = []
        for k in range(min(self.running + 1, len(self.texts))):
            out += self.logprobs[k][self.logprobs_sent[k]:]
            self.logprobs_sent[k] = len(self.logprobs[k])
        return out


async def stream(state: Any, req: RelayedRequest, seconds: float | None = None) -> AsyncGenerator[str, None]:
    """OpenAI's transcription events: `transcript.text.delta` as the text comes (the pieces
    in order), then `transcript.text.done` with all of it and the usage (`seconds`: of audio,
    usage_of's); a failure is an `error` event."""
    renderer, collector = ChatRenderer(), Collector(req)
    order = InOrder(req.num_choices)
    logprobs: list[dict[str, Any]] = []  # all that went out (include logprobs)
    async with aclosing(relayed_chunks(state, req, renderer, collector)) as chunks:
        async for chunk in chunks:
            if isinstance(chunk, StreamError):
                yield format_sse({"type": "error", "error": {"message": chunk.message, "type": chunk.type,
                                                             "code": chunk.code}})
                yield DONE
                return
            if chunk:
                choice = chunk["choices"][0]
                written = written_logprobs(ended_without_end((choice.get("logprobs") or {}).get("content") or [],
                                                             choice["finish_reason"]))
                if new := order.add(choice["index"], choice["delta"].get("content") or "",
                                    choice["finish_reason"] is not None, written):
                    event: dict[str, Any] = {"type": "transcript.text.delta", "delta": new}
                    if req.logprobs:
                        logprobs += (taken := order.taken_logprobs())
                        event["logprobs"] = taken
                    yield format_sse(event)
    text = joined([c.text for c in collector.choices])
    done: dict[str, Any] = {"type": "transcript.text.done", "text": text, "usage": usage_of(collector.usage(), seconds)}
    if req.logprobs:
        done["logprobs"] = logprobs + order.taken_logprobs()
    yield format_sse(done)
    yield DONE
