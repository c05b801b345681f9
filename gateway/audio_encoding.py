"""Encoding the 24 kHz speech for the client in the format the request asked for.

``audio.format`` is exactly one of ``wav`` (default), ``pcm``/``pcm16`` (raw s16le, normalised to
``pcm``), ``flac``, ``mp3`` or ``opus`` (Ogg Opus); anything else is a 400 before any work starts.
Every streamed chunk is encoded on its own, so each chunk decodes independently (with ``wav`` each chunk
is a complete RIFF file), as vLLM-Omni clients expect.
"""

from __future__ import annotations

import numpy as np

from services.common.audio import encode_file, float_to_pcm16

SUPPORTED_FORMATS: tuple[str, ...] = ("wav", "pcm", "flac", "mp3", "opus")
_ALIASES = {"pcm16": "pcm"}
# soundfile (libsndfile >= 1.1) container/subtype per format.
_SOUNDFILE: dict[str, tuple[str, str]] = {
    "wav": ("WAV", "PCM_16"),
    "flac": ("FLAC", "PCM_16"),
    "mp3": ("MP3", "MPEG_LAYER_III"),
    "opus": ("OGG", "OPUS"),
}
MIME_TYPES = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
}


def normalize_format(value: object) -> str | None:
    """The canonical format name, or None when ``value`` is not a supported format."""
    if not isinstance(value, str):
        return None
    fmt = _ALIASES.get(value.lower(), value.lower())
    return fmt if fmt in SUPPORTED_FORMATS else None


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """Mono float samples -> bytes of one complete file (or raw s16le for ``pcm``)."""
    if fmt == "pcm":
        return float_to_pcm16(samples).tobytes()
    container, subtype = _SOUNDFILE[fmt]
    return encode_file(samples, sample_rate, container, subtype)
