"""Images in chat messages: OpenAI's `image_url` content parts, for a model that takes images
(worker.core.multimodal); and audio clips: OpenAI's `input_audio` and vLLM's `audio_url`, for a model
that takes audio. The job carries each image's encoded bytes, so it holds all it needs
wherever and whenever a worker takes it (a reclaimed job too): a data URL is decoded here,
and an http(s) URL (of an image or of an `audio_url` clip) is fetched here, before the job is
queued (`GENQ_FETCH_IMAGE_URLS` off refuses those: fetching makes the API server open any URL
a client names). No image is decoded here; the worker reads them and says which it cannot.
Clips are read here, and queued as 16 kHz WAV.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from typing import Any

import httpx

from api.errors import invalid_param
from api.request_bodies import MEDIA_PARTS
from api.settings import Settings
from producer.audio import AUDIO_RATE, read_clip, to_wav
from producer.data_urls import decode_data_url, image_url_of, is_data_url


def image_part(url: str, where: str) -> dict[str, Any]:
    """The job's part for a data URL: the image's bytes; 400 naming `where` if it is not one."""
    try:
        return {"type": "image", "image": _data_of(url, where, "image")}
    except ValueError as e:
        hint = "" if is_data_url(url) else " or an http(s) URL"
        raise invalid_param(where, f"{e}{hint}") from None


def _data_of(url: str, where: str, kind: str) -> bytes:
    if url.startswith(("http://", "https://")):  # left by a path that does not fetch (a batch line)
        raise invalid_param(where, f"{kind} URLs are fetched for chat and Responses requests only: send a data URL")
    return decode_data_url(url)


async def inline_media_urls(messages: list[Any], settings: Settings) -> None:
    """Replace each http(s) URL of the messages' image and audio_url parts by a data URL of
    what it serves; 400 naming the part when it cannot be fetched, is too large, or fetching
    is off, and naming `messages` when they hold more images and clips than
    GENQ_MAX_IMAGES_PER_REQUEST (each is an encoder run)."""
    media = [(f"messages[{i}].content[{j}].{part.type}", part) for i, message in enumerate(messages)
             if isinstance(message.content, list) for j, part in enumerate(message.content)
             if part.type in MEDIA_PARTS]
    if len(media) > settings.max_images_per_request:
        raise invalid_param("messages", f"the messages hold {len(media)} images or clips, more than this server "
                            f"takes in one request ({settings.max_images_per_request}, GENQ_MAX_IMAGES_PER_REQUEST)")
    wanted = [(where, part) for where, part in media
              if part.type in _FETCHED and url_of(part).startswith(("http://", "https://"))]
    if not wanted:
        return
    if not settings.fetch_image_urls:
        raise invalid_param(wanted[0][0], "this server does not fetch image or audio URLs "
                            "(GENQ_FETCH_IMAGE_URLS=false): send a data URL")
    async with httpx.AsyncClient(timeout=settings.image_fetch_timeout_s, follow_redirects=True) as client:
        fetched = await asyncio.gather(*(_fetch(client, url_of(part), where, *_FETCHED[part.type](settings))
                                         for where, part in wanted))
    for (_, part), (data, kind) in zip(wanted, fetched, strict=True):
        setattr(part, part.type, {"url": f"data:{kind};base64,{base64.b64encode(data).decode()}"})


# the parts whose URLs are fetched: what they hold, and the most bytes taken
_FETCHED = {
    "image_url": lambda settings: ("image", settings.max_image_bytes, "GENQ_MAX_IMAGE_BYTES"),
    "audio_url": lambda settings: ("clip", settings.max_audio_bytes, "GENQ_MAX_AUDIO_BYTES"),
}


async def _fetch(client: httpx.AsyncClient, url: str, where: str, kind: str, max_bytes: int,
                 setting: str) -> tuple[bytes, str]:
    try:
        async with client.stream("GET", url) as response:
            if response.status_code != 200:
                raise invalid_param(where, f"fetching {url} answered {response.status_code}")
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > max_bytes:
                    raise invalid_param(where, f"the {kind} at {url} is larger than {max_bytes} bytes ({setting})")
            return bytes(data), response.headers.get("content-type", "application/octet-stream")
    except httpx.HTTPError as e:
        raise invalid_param(where, f"fetching {url} failed: {type(e).__name__}") from None


AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")  # input_audio's `format`s taken (the worker reads the bytes)


def audio_part(part: Any, where: str) -> dict[str, Any]:
    """The job's part for an audio clip, from OpenAI's `input_audio` ({"data": base64,
    "format": "wav" or "mp3"}) or vLLM's `audio_url` (a data URL, which an http(s) URL
    became in inline_media_urls): the clip read here and queued as 16-bit mono WAV at 16 kHz
    (producer.audio), whatever it came as, so the job stays small; 400 naming `where` for what
    is not a readable clip."""
    if part.type == "input_audio":
        audio = part.input_audio or {}
        if audio.get("format", "wav") not in AUDIO_FORMATS:
            raise invalid_param(f"{where}.format", f"audio format {audio.get('format')!r} is not taken: "
                                f"send {', '.join(AUDIO_FORMATS)}")
        if not isinstance(audio.get("data"), str):
            raise invalid_param(f"{where}.data", "input_audio needs its data: the audio file, base64")
        try:
            data = base64.b64decode(audio["data"], validate=True)
        except binascii.Error:
            raise invalid_param(f"{where}.data", "input_audio data is not valid base64") from None
    else:
        try:
            data = _data_of(url_of(part), where, "audio")
        except ValueError as e:
            raise invalid_param(where, f"an audio_url must be a base64 data URL (data:audio/wav;base64,...) "
                                f"or an http(s) URL: {e}") from None
    try:
        return {"type": "audio", "audio": to_wav(read_clip(data, "the clip", AUDIO_RATE), AUDIO_RATE)}
    except ValueError as e:
        raise invalid_param(where, str(e)) from None


def url_of(part: Any) -> str:
    """The URL of an image_url or audio_url part."""
    return str(image_url_of({"image_url": getattr(part, part.type)}) or "")
