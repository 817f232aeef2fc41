"""Images in chat content parts as OpenAI writes them: `{"type": "image_url", "image_url":
{"url": ...}}` (or the URL alone), the URL a base64 data URL. Shared by the protocol's checks,
the API and the worker; no I/O, no image decoding."""

from __future__ import annotations

import base64
import binascii
from typing import Any


def image_url_of(part: dict[str, Any]) -> Any:
    """The URL of an `image_url` part: its `{"url": ...}` mapping's, or the value itself."""
    value = part.get("image_url")
    return value.get("url") if isinstance(value, dict) else value


def is_data_url(url: Any) -> bool:
    return isinstance(url, str) and url.startswith("data:")


def decode_data_url(url: str) -> bytes:
    """The bytes of a base64 data URL; ValueError saying what is wrong with it."""
    header, comma, payload = url.partition(",")
    if not (is_data_url(url) and comma and header.endswith(";base64")):
        raise ValueError("an image_url must be a base64 data URL (data:image/png;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error:
        raise ValueError("the image's data URL is not valid base64") from None


def bytes_if_data_url(value: Any, what: str) -> Any:
    """The bytes of `value` when it is a data URL (ValueError naming `what`, "image 0", when
    it is not a valid one), else `value` itself."""
    if not is_data_url(value):
        return value
    try:
        return decode_data_url(value)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
