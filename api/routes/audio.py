"""`POST /v1/audio/transcriptions` and `/v1/audio/translations` (OpenAI's), for models that take
audio: run as a chat with the clip, a long one as one chat per piece (api.transcriptions)."""

from __future__ import annotations

from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from api import generate, transcriptions
from api.chat import chat_prompt, templated
from api.deps import StateDep
from api.openapi import AUDIO_FORM
from api.render import ChatRenderer
from api.sse import EventStreamResponse, unless_disconnected
from api.tokenizers import base_model
from api.transcriptions import AudioRequest, ChoicesOnly, Decoded, WhisperPrompts

router = APIRouter(prefix="/audio", tags=["openai"])


@router.post("/transcriptions", openapi_extra=AUDIO_FORM)
async def create_transcription(request: Request, state: StateDep) -> Response:
    """The speech of a WAV file as text, in its own language (a multipart form: `file`,
    `model`, `language`, `prompt`, `response_format`, `temperature`, `stream`)."""
    return await _respond(request, state, "transcribe")


@router.post("/translations", openapi_extra=AUDIO_FORM)
async def create_translation(request: Request, state: StateDep) -> Response:
    """The speech of a WAV file as English text (`file`, `model`, `prompt`,
    `response_format`, `temperature`)."""
    return await _respond(request, state, "translate")


async def _respond(request: Request, state: StateDep, task: str) -> Response:
    async with request.form() as form:
        audio = await AudioRequest.from_form(task, form, state.settings.max_audio_bytes)
    whisper = await _whisper(state, audio.model)
    audio.check(whisper)
    pieces = transcriptions.split_wav(audio.audio, state.settings.audio_chunk_s)
    language = audio.language
    if whisper is not None:
        whisper.check(language)
        if whisper.english_only:
            language = "en"
        elif language is None and whisper.languages:
            language = await unless_disconnected(request, _heard_language(state, audio, whisper, pieces[0]))
    if whisper is not None and not audio.stream:
        decoded = await unless_disconnected(request, _decoded(state, audio, whisper, pieces, language))
        heard = [reply for reply, _ in transcriptions.heard(pieces, decoded, state.settings)]
        segments = None
        if audio.timed(whisper):
            segments = transcriptions.timed_segments(whisper, pieces, decoded, state.settings)
            text = transcriptions.joined([segment["text"] for segment in segments])
        else:
            text = transcriptions.joined([d.text for d in heard])
        written = transcriptions.written_logprobs([lp for d in heard for lp in d.logprobs])
        words = (transcriptions.timed_words(whisper, pieces, decoded, state.settings, language)
                 if "word" in audio.granularities else None)
        return _body(transcriptions.response(audio, text, None, language, segments, written, words))
    chats = [templated(chat, state.settings) for chat in audio.as_chats(pieces, state.settings, whisper, language)]
    req = await generate.start(state, chats[0], [chat_prompt(chat) for chat in chats], ChatRenderer())
    if audio.stream:
        seconds = transcriptions.duration_s(audio.audio) if whisper is not None else None
        return EventStreamResponse(transcriptions.stream(state, req, seconds))
    reply = await unless_disconnected(request, generate.collect(state, req, ChatRenderer()))
    text = transcriptions.joined([choice.message.content or "" for choice in reply.choices])
    written = transcriptions.written_logprobs([
        lp for choice in reply.choices
        for lp in transcriptions.ended_without_end((choice.logprobs or {}).get("content", []), choice.finish_reason)])
    return _body(transcriptions.response(audio, text, reply.usage, logprobs=written))


def _body(body: dict | str) -> Response:
    return PlainTextResponse(body) if isinstance(body, str) else JSONResponse(body)


async def _decoded(state: StateDep, audio: AudioRequest, whisper: WhisperPrompts, pieces: list[bytes],
                   language: str | None) -> list[Decoded]:
    """Each piece decoded (_decoded_at_once): all at once, or with
    GENQ_WHISPER_CONDITION_ON_PREVIOUS_TEXT one after another, each prompted with the text of
    the pieces before it (after the form's prompt), as openai-whisper's transcribe windows
    are: a piece that had to be decoded hotter than 0.5 starts the text afresh, a silent
    piece adds none."""
    if not state.settings.whisper_condition_on_previous_text:
        return await _decoded_at_once(state, audio, whisper, pieces, language)
    decoded: list[Decoded] = []
    before = [audio.prompt] if audio.prompt else []
    for piece in pieces:
        prompted = replace(audio, prompt=transcriptions.joined(before) or None)
        [reply] = await _decoded_at_once(state, prompted, whisper, [piece], language)
        decoded.append(reply)
        if reply.temperature > transcriptions.PROMPT_RESET_TEMPERATURE:
            before = []
        elif not reply.silent(state.settings):
            before.append(reply.text)
    return decoded


async def _decoded_at_once(state: StateDep, audio: AudioRequest, whisper: WhisperPrompts, pieces: list[bytes],
                           language: str | None) -> list[Decoded]:
    """Each piece decoded as whisper-1 decodes: at the form's temperature, or from 0 with its
    fallback (FALLBACK_TEMPERATURES: the pieces that need it, all at once, each round hotter,
    each piece sampled FALLBACK_BEST_OF times and the likeliest kept, until none needs it or
    the last is reached). How likely <|nospeech|> was is read from the first round's prompts."""
    temperatures = transcriptions.FALLBACK_TEMPERATURES if audio.temperature == 0 else (audio.temperature,)
    decoded: dict[int, Decoded] = {}  # piece -> its latest decode
    todo = list(range(len(pieces)))
    for temperature in temperatures:
        n = transcriptions.FALLBACK_BEST_OF if temperature > 0 and len(temperatures) > 1 else 1
        chats = [templated(chat, state.settings) for chat in audio.as_chats(
            [pieces[i] for i in todo], state.settings, whisper, language, temperature, no_speech=not decoded, n=n)]
        req = await generate.start(state, chats[0], [chat_prompt(chat) for chat in chats], ChatRenderer())
        choices = await generate.collect(state, req, ChoicesOnly())  # (each piece's n in a row)
        for k, i in enumerate(todo):
            samples = choices[k * n:(k + 1) * n]
            no_speech = decoded[i].no_speech_prob if i in decoded else whisper.no_speech_prob(samples[0].prompt_logprobs)
            decoded[i] = max((whisper.decoded(choice, temperature, no_speech) for choice in samples),
                             key=lambda d: d.avg_logprob)
        todo = [i for i in todo if decoded[i].needs_fallback(state.settings)]
        if not todo:
            break
    return [decoded[i] for i in range(len(pieces))]


async def _whisper(state: StateDep, model: str) -> WhisperPrompts | None:
    """What the model's tokenizer says of Whisper prompts; None for a model of another kind."""
    base, max_model_len = await base_model(state.cluster, await generate.resolve_model(state, model))
    return WhisperPrompts.of(await state.tokenizers.get(state.client, base), max_model_len)


async def _heard_language(state: StateDep, audio: AudioRequest, whisper: WhisperPrompts, first: bytes) -> str:
    """The language Whisper hears in the `first` piece: its one token of a language."""
    chat = templated(audio.detecting_chat(whisper, first), state.settings)
    req = await generate.start(state, chat, [chat_prompt(chat)], ChatRenderer())
    reply = await generate.collect(state, req, ChatRenderer())
    return whisper.languages[(reply.choices[0].token_ids or [-1])[0]]
