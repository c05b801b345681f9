"""OpenAI's audio output dialect for ``/v1/chat/completions`` (requests that carry the ``audio`` object).

Two dialects share the route (docs/api.md, "Audio output"):

* OpenAI (the body has ``audio: {voice, format}``): the words go to ``audio.transcript`` and the speech
  to ``audio.data``. Streamed, every ``delta.audio`` carries the response's audio ``id`` and either
  ``data`` (base64 24 kHz mono 16-bit little-endian PCM, whatever ``format`` says, as OpenAI streams) or
  a ``transcript`` fragment; ``expires_at`` rides on the first audio delta. Non-streamed,
  ``message.audio`` is ``{id, data, expires_at, transcript}`` with ``data`` one file in ``format``
  and ``transcript`` the words spoken (the text part, tool calls excluded). ``message.content`` is null,
  as OpenAI's own audio responses.
* vLLM-Omni (no ``audio`` object): speech as base64 chunks in ``delta.content`` with ``modality``
  ``"audio"`` and ``audio_metadata``; unchanged.

Voices (gateway/audio/chat_voice.py): OpenAI's voice names (``alloy``, ``verse``, ...) map to the
default voice, a registered voice is used by its name, ``ref_audio`` sets one inline.
"""

from __future__ import annotations

import base64
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.audio_encoding import encode_audio, normalize_format
from gateway.pipeline import OUTPUT_SAMPLE_RATE
from services.common.audio import float_to_pcm16

AUDIO_TTL_S = 24 * 3600


@dataclass
class OpenAIAudioOut:
    """The audio object of one response in OpenAI's shape."""

    format: str  # OpenAI's name: wav, pcm16, mp3, flac, opus
    id: str = field(default_factory=lambda: "audio_" + secrets.token_hex(12))
    expires_at: int = field(default_factory=lambda: int(time.time()) + AUDIO_TTL_S)
    sent_header: bool = False

    def _head(self) -> dict[str, Any]:
        head: dict[str, Any] = {"id": self.id}
        if not self.sent_header:
            head["expires_at"] = self.expires_at
            self.sent_header = True
        return head

    def data_delta(self, samples: np.ndarray) -> dict[str, Any]:
        """A streamed ``delta.audio`` with one chunk of 24 kHz PCM16."""
        pcm = float_to_pcm16(samples).tobytes()
        return {**self._head(), "data": base64.b64encode(pcm).decode()}

    def transcript_delta(self, text: str) -> dict[str, Any]:
        return {**self._head(), "transcript": text}

    def message(self, samples: np.ndarray, transcript: str) -> dict[str, Any]:
        """The non-streamed ``message.audio``: one file in the requested format."""
        fmt = normalize_format(self.format) or "wav"
        data = encode_audio(samples, OUTPUT_SAMPLE_RATE, fmt)
        return {
            "id": self.id,
            "data": base64.b64encode(data).decode(),
            "expires_at": self.expires_at,
            "transcript": transcript,
        }
