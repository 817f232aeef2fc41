"""Audio clips in prompts, read into what an audio encoder's feature extractor takes: mono
float32 samples at its sampling rate. The worker reads clips with it; the API too, before it
queues them, as 16-bit mono WAV at AUDIO_RATE (to_wav), so a job carries a small clip in one
format and a clip that cannot be read is a 400 naming its part. No torch here.

A clip comes as the bytes of an audio file (WAV, PCM of 8 to 32 bits, read by the standard
library; MP3, FLAC, OGG and the other formats of libsndfile, through soundfile), any rate and
channel count, as a base64 data URL of them (data:audio/wav;base64,...), or as samples
already decoded: vLLM's `(array, sampling rate)` pair, or an array at the extractor's rate.
Channels are averaged; another rate is resampled, band-limited, through the clip's spectrum.
"""

from __future__ import annotations

import io
import wave
from typing import Any

import numpy as np

from producer.data_urls import bytes_if_data_url

_PCM = {1: np.uint8, 2: np.int16, 4: np.int32}  # sample width in bytes -> its integer type (8-bit is unsigned)
AUDIO_RATE = 16_000  # the rate of the clips the API queues: every audio model genq serves reads 16 kHz


def read_clip(clip: Any, name: str, sampling_rate: int) -> np.ndarray:
    """A clip as mono float32 samples at `sampling_rate`; ValueError naming it (`name`: "audio
    0", "the file") and what is wrong."""
    clip = bytes_if_data_url(clip, name)
    if isinstance(clip, (bytes, bytearray)):
        samples, rate = _wav(bytes(clip), name)
    elif isinstance(clip, tuple) and len(clip) == 2:
        samples, rate = _array(clip[0], name), clip[1]
    else:
        samples, rate = _array(clip, name), sampling_rate
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or rate <= 0:
        raise ValueError(f"{name}: its sampling rate must be a positive number, got {rate!r}")
    if samples.size == 0:
        raise ValueError(f"{name} holds no samples")
    return resample(samples, float(rate), sampling_rate)


def resample(samples: np.ndarray, rate: float, to_rate: int) -> np.ndarray:
    """`samples` at `rate` brought to `to_rate`: the spectrum cut (or padded) to the new
    length's, so nothing above the lower rate's Nyquist frequency folds back."""
    if rate == to_rate:
        return samples.astype(np.float32, copy=False)
    length = max(1, round(len(samples) * to_rate / rate))
    spectrum = np.fft.rfft(samples.astype(np.float64))
    bins = length // 2 + 1
    kept = np.zeros(bins, dtype=spectrum.dtype)
    kept[: min(bins, len(spectrum))] = spectrum[:bins]
    return (np.fft.irfft(kept, n=length) * (length / len(samples))).astype(np.float32)


def to_wav(samples: np.ndarray, rate: int) -> bytes:
    """Mono float samples as 16-bit PCM WAV bytes (samples read from such a WAV come back the
    same)."""
    ints = np.clip(np.round(samples.astype(np.float64) * 2**15), -(2**15), 2**15 - 1).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(rate)
        writer.writeframes(ints.tobytes())
    return out.getvalue()


def _wav(data: bytes, name: str) -> tuple[np.ndarray, int]:
    try:
        with wave.open(io.BytesIO(data)) as reader:
            width, channels, rate = reader.getsampwidth(), reader.getnchannels(), reader.getframerate()
            frames = reader.readframes(reader.getnframes())
    except (wave.Error, EOFError):
        return _other(data, name)
    if width == 3:  # 24-bit: widened to 32 bits, the low byte zero
        raw = np.frombuffer(frames, dtype=np.uint8).reshape(-1, 3)
        samples = (np.pad(raw, ((0, 0), (1, 0))).view("<i4")[:, 0].astype(np.float64)) / 2**31
    elif width in _PCM:
        ints = np.frombuffer(frames, dtype=np.dtype(_PCM[width]).newbyteorder("<"))
        samples = (ints.astype(np.float64) - 128) / 128 if width == 1 else ints.astype(np.float64) / 2 ** (8 * width - 1)
    else:
        raise ValueError(f"{name}: WAV samples of {width} bytes are not read; send 8, 16, 24 or 32-bit PCM")
    return samples.reshape(-1, channels).mean(axis=1).astype(np.float32), rate


def _other(data: bytes, name: str) -> tuple[np.ndarray, int]:
    """A file of another format than PCM WAV (MP3, FLAC, OGG, float WAV, ...), via libsndfile."""
    import soundfile

    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (RuntimeError, TypeError) as e:  # (soundfile's errors are RuntimeErrors)
        why = getattr(e, "error_string", None) or str(e)
        raise ValueError(f"{name} is not audio that can be read (WAV, MP3, FLAC, OGG, ...): {why}") from None
    return samples.mean(axis=1).astype(np.float32), int(rate)


def _array(samples: Any, name: str) -> np.ndarray:
    try:
        array = np.asarray(samples, dtype=np.float32)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be WAV bytes, a data URL, samples, or (samples, sampling rate); "
                         f"got {type(samples).__name__}") from None
    if array.ndim == 2:  # [samples, channels] as soundfile reads them
        array = array.mean(axis=1)
    if array.ndim != 1:
        raise ValueError(f"{name}: samples must be one channel or [samples, channels], got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError(f"{name}: its samples must be finite numbers")
    return array
