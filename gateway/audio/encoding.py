"""Streaming audio encoders for ``/v1/audio/speech``: float samples in, container bytes out as they form.

``wav`` streams one RIFF file whose size fields say "unknown" (0xFFFFFFFF, as OpenAI's streamed wav
does), ``pcm`` is raw s16le, and ``mp3`` / ``flac`` / ``opus`` (Ogg) / ``aac`` (ADTS) are encoded by
FFmpeg through PyAV into a non-seekable sink, so each :meth:`StreamEncoder.push` returns whatever bytes the
muxer has written so far and the concatenation of every return value is one valid file. The Ogg muxer is
asked for 20 ms pages: with its default (1 s) nothing would reach the client until a second of audio.
"""

from __future__ import annotations

import io
import struct
from typing import Any

import numpy as np

from services.common.audio import float_to_pcm16

SPEECH_FORMATS: tuple[str, ...] = ("mp3", "opus", "aac", "flac", "wav", "pcm")
MIME_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
# format -> (PyAV container format, codec, muxer options)
_FFMPEG: dict[str, tuple[str, str, dict[str, str]]] = {
    "mp3": ("mp3", "libmp3lame", {}),
    "opus": ("ogg", "libopus", {"page_duration": "20000"}),
    "aac": ("adts", "aac", {}),
    "flac": ("flac", "flac", {}),
}


class _Sink(io.RawIOBase):
    """A write-only, non-seekable file for the muxer; :meth:`take` hands over what it wrote."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._buf += view
        return view.nbytes

    def take(self) -> bytes:
        out, self._buf = bytes(self._buf), bytearray()
        return out


def wav_stream_header(sample_rate: int) -> bytes:
    """A 16-bit mono RIFF header whose RIFF and data sizes are 0xFFFFFFFF (length unknown, streaming)."""
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", 0xFFFFFFFF)
        + b"WAVEfmt "
        + struct.pack("<I", 16)
        + fmt
        + b"data"
        + struct.pack("<I", 0xFFFFFFFF)
    )


class StreamEncoder:
    """One response's encoder: :meth:`push` float mono samples, then :meth:`close` once for the tail."""

    def __init__(self, fmt: str, sample_rate: int) -> None:
        if fmt not in SPEECH_FORMATS:
            raise ValueError(f"unknown format {fmt!r}")
        self.fmt = fmt
        self.sample_rate = sample_rate
        self._header_sent = False
        self._container: Any = None
        self._stream: Any = None
        self._sink: _Sink | None = None
        if fmt in _FFMPEG:
            import av

            container_fmt, codec, options = _FFMPEG[fmt]
            self._sink = _Sink()
            self._container = av.open(self._sink, mode="w", format=container_fmt, options=options)
            self._stream = self._container.add_stream(codec, rate=sample_rate)
            self._stream.layout = "mono"

    def push(self, samples: np.ndarray) -> bytes:
        pcm = float_to_pcm16(np.asarray(samples, dtype=np.float32).reshape(-1))
        if self.fmt == "pcm":
            return pcm.tobytes()
        if self.fmt == "wav":
            head = b""
            if not self._header_sent:
                head, self._header_sent = wav_stream_header(self.sample_rate), True
            return head + pcm.tobytes()
        if pcm.size == 0:
            return b""
        return self._encode(pcm)

    def close(self) -> bytes:
        if self.fmt == "wav" and not self._header_sent:
            self._header_sent = True
            return wav_stream_header(self.sample_rate)
        if self._container is None:
            return b""
        assert self._sink is not None
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        self._container = None
        return self._sink.take()

    def abort(self) -> None:
        """Release the FFmpeg contexts without finishing the file (the client went away)."""
        if self._container is not None:
            try:
                self._container.close()
            except Exception:  # noqa: BLE001 - a half-written muxer may complain; nothing to save
                pass
            self._container = None

    def _encode(self, pcm: np.ndarray) -> bytes:
        import av

        assert self._sink is not None
        frame = av.AudioFrame.from_ndarray(pcm[None, :], format="s16", layout="mono")
        frame.sample_rate = self.sample_rate
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._sink.take()


def encode_whole(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """One complete file (wav with exact sizes, via soundfile's layout) for a non-streamed response."""
    if fmt == "wav":
        from services.common.audio import wav_bytes

        return wav_bytes(samples, sample_rate)
    enc = StreamEncoder(fmt, sample_rate)
    return enc.push(samples) + enc.close()
