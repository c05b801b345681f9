"""Audio in and out of the realtime socket.

Input: base64 appends in any supported format and declared rate are decoded to mono float32 at 16 kHz
(the thinker's unit rate) and cut into exact 1 s units regardless of how the client sized its appends.
Output: 24 kHz float samples from code2wav are rendered as pcm16, standalone WAV, or G.711.
Resampling, the PCM16 scale and the WAV writer are :mod:`services.common.audio`'s (``resample`` is
re-exported here for the realtime modules that import it from this one).
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass

import numpy as np

from gateway.realtime.errors import RealtimeError
from services.common.audio import float_to_pcm16, pcm16_to_float, wav_bytes
from services.common.audio import resample as resample  # re-exported for the realtime pipeline

UNIT_RATE = 16_000
UNIT_SAMPLES = 16_000  # one 1 s unit at 16 kHz (docs/model.md, Duplex)
OUTPUT_RATE = 24_000
MIN_RATE, MAX_RATE = 8_000, 192_000

_PCM16_NAMES = {"pcm16", "pcm_s16le", "s16le", "audio/pcm", "pcm"}
_F32_NAMES = {"pcm_f32le", "f32le", "audio/pcm_f32le"}
_ULAW_NAMES = {"g711_ulaw", "audio/pcmu", "pcmu"}
_ALAW_NAMES = {"g711_alaw", "audio/pcma", "pcma"}
OUTPUT_FORMATS = {"pcm16", "wav", "g711_ulaw", "g711_alaw"}


def canonical_input_format(name: str) -> str:
    """Map a client spelling to one of pcm16 / pcm_f32le / g711_ulaw / g711_alaw."""
    key = str(name).strip().lower()
    if key in _PCM16_NAMES:
        return "pcm16"
    if key in _F32_NAMES:
        return "pcm_f32le"
    if key in _ULAW_NAMES:
        return "g711_ulaw"
    if key in _ALAW_NAMES:
        return "g711_alaw"
    raise RealtimeError(
        "unsupported_audio_format", f"unsupported input audio format {name!r}", param="format"
    )


def default_rate_for(fmt: str) -> int:
    return 8_000 if fmt.startswith("g711") else UNIT_RATE


def validate_rate(rate: object, param: str = "sample_rate_hz") -> int:
    """Declared rates must be integers in [8 kHz, 192 kHz] (invariant I1)."""
    if (
        isinstance(rate, bool)
        or not isinstance(rate, (int, float))
        or (isinstance(rate, float) and not rate.is_integer())
    ):
        raise RealtimeError("bad_event", f"{param} must be an integer number of Hz", param=param)
    value = int(rate)
    if not MIN_RATE <= value <= MAX_RATE:
        raise RealtimeError("bad_event", f"{param} must be within [{MIN_RATE}, {MAX_RATE}]", param=param)
    return value


def strict_b64decode(data: object, param: str = "audio") -> bytes:
    """Decode base64 strictly: anything outside the alphabet or with bad padding is ``bad_audio``."""
    if not isinstance(data, str):
        raise RealtimeError("bad_event", f"{param} must be a base64 string", param=param)
    if data.startswith("data:"):
        data = data.split(",", 1)[1] if "," in data else ""
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RealtimeError("bad_audio", f"{param} is not valid base64", param=param) from exc


# --- G.711 (ITU-T) --------------------------------------------------------------------------------


def _ulaw_table() -> np.ndarray:
    codes = ~np.arange(256, dtype=np.int32) & 0xFF
    sign = codes & 0x80
    exponent = (codes >> 4) & 0x07
    mantissa = codes & 0x0F
    magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
    return np.where(sign != 0, -magnitude, magnitude).astype(np.int16)


def _alaw_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.int32) ^ 0x55
    sign = codes & 0x80
    exponent = (codes >> 4) & 0x07
    mantissa = codes & 0x0F
    magnitude = np.where(
        exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0)
    )
    return np.where(sign != 0, magnitude, -magnitude).astype(np.int16)


ULAW_DECODE = _ulaw_table()
ALAW_DECODE = _alaw_table()


def _build_encoder(decode_table: np.ndarray) -> np.ndarray:
    """Encoder as a 65536-entry lookup: for every int16 value, the code whose decoded value is nearest."""
    order = np.argsort(decode_table.astype(np.int32), kind="stable")
    sorted_vals = decode_table[order].astype(np.int32)
    grid = np.arange(-32768, 32768, dtype=np.int32)
    idx = np.clip(np.searchsorted(sorted_vals, grid), 1, len(sorted_vals) - 1)
    left, right = sorted_vals[idx - 1], sorted_vals[idx]
    pick = np.where(np.abs(grid - left) <= np.abs(right - grid), idx - 1, idx)
    return order[pick].astype(np.uint8)


_ULAW_ENCODE: np.ndarray | None = None
_ALAW_ENCODE: np.ndarray | None = None


def g711_encode(samples_i16: np.ndarray, law: str) -> bytes:
    global _ULAW_ENCODE, _ALAW_ENCODE
    if law == "ulaw":
        if _ULAW_ENCODE is None:
            _ULAW_ENCODE = _build_encoder(ULAW_DECODE)
        table = _ULAW_ENCODE
    else:
        if _ALAW_ENCODE is None:
            _ALAW_ENCODE = _build_encoder(ALAW_DECODE)
        table = _ALAW_ENCODE
    return table[samples_i16.astype(np.int32) + 32768].tobytes()


# --- input decoding -------------------------------------------------------------------------------


def decode_input_audio(raw: bytes, fmt: str, rate: int) -> np.ndarray:
    """Bytes of one append → mono float32 at 16 kHz."""
    if fmt == "pcm16":
        if len(raw) % 2:
            raise RealtimeError("bad_audio", "pcm16 audio has an odd number of bytes", param="audio")
        x = pcm16_to_float(raw)
    elif fmt == "pcm_f32le":
        if len(raw) % 4:
            raise RealtimeError(
                "bad_audio", "pcm_f32le audio is not a whole number of samples", param="audio"
            )
        x = np.frombuffer(raw, dtype="<f4").astype(np.float32)
        if not np.all(np.isfinite(x)):
            raise RealtimeError("bad_audio", "pcm_f32le audio contains non-finite samples", param="audio")
        x = np.clip(x, -1.0, 1.0)
    elif fmt == "g711_ulaw":
        x = pcm16_to_float(ULAW_DECODE[np.frombuffer(raw, dtype=np.uint8)])
    elif fmt == "g711_alaw":
        x = pcm16_to_float(ALAW_DECODE[np.frombuffer(raw, dtype=np.uint8)])
    else:  # pragma: no cover - formats are canonicalised before this point
        raise RealtimeError("unsupported_audio_format", f"unsupported input audio format {fmt!r}")
    return resample(x, rate, UNIT_RATE)


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64)))) if x.size else 0.0


@dataclass
class AudioUnit:
    """One 1 s input unit for the thinker: 16 000 samples, frames attached to the append that closed it."""

    index: int
    samples: np.ndarray
    frames: list[bytes]
    is_speech: bool


class UnitAssembler:
    """Cuts arbitrary-size appends into 1 s units; unit k closes when 1000·(k+1) ms have been appended."""

    def __init__(self) -> None:
        self._pending: list[np.ndarray] = []
        self._pending_samples = 0
        self._pending_speech = False
        # Frames sent on an append that closed no unit wait for the next unit (latest frames win).
        self._pending_frames: list[bytes] = []
        self.next_index = 0
        self.total_samples = 0

    @property
    def pending_samples(self) -> int:
        return self._pending_samples

    def push(self, x: np.ndarray, frames: list[bytes], is_speech: bool) -> list[AudioUnit]:
        """Add samples; return the units this append closed (frames go to the last closed unit)."""
        self._pending.append(x)
        self._pending_samples += x.size
        self.total_samples += x.size
        self._pending_speech = self._pending_speech or is_speech
        if frames:
            self._pending_frames = frames
        units: list[AudioUnit] = []
        if self._pending_samples >= UNIT_SAMPLES:
            buf = np.concatenate(self._pending)
            while buf.size >= UNIT_SAMPLES:
                units.append(AudioUnit(self.next_index, buf[:UNIT_SAMPLES].copy(), [], self._pending_speech))
                self.next_index += 1
                buf = buf[UNIT_SAMPLES:]
            self._pending = [buf] if buf.size else []
            self._pending_samples = buf.size
            self._pending_speech = is_speech and buf.size > 0
        if units and self._pending_frames:
            units[-1].frames = self._pending_frames
            self._pending_frames = []
        return units

    def flush(self) -> AudioUnit | None:
        """Close a residual partial unit, zero-padded to 1 s (docs/protocol.md, Realtime commit and lanes)."""
        if not self._pending_samples:
            return None
        buf = np.concatenate(self._pending)
        padded = np.zeros(UNIT_SAMPLES, dtype=np.float32)
        padded[: buf.size] = buf
        unit = AudioUnit(self.next_index, padded, self._pending_frames, self._pending_speech)
        self._pending_frames = []
        self.next_index += 1
        self._pending, self._pending_samples, self._pending_speech = [], 0, False
        return unit

    def clear(self) -> None:
        self._pending, self._pending_samples, self._pending_speech = [], 0, False
        self._pending_frames = []


# --- output ---------------------------------------------------------------------------------------


def encode_output_audio(samples_24k: np.ndarray, fmt: str) -> tuple[bytes, int]:
    """Render a chunk of 24 kHz float audio for the client; returns (payload, sample_rate)."""
    if fmt in ("g711_ulaw", "g711_alaw"):
        x = resample(samples_24k, OUTPUT_RATE, 8_000)
        return g711_encode(float_to_pcm16(x), fmt[5:]), 8_000
    if fmt == "wav":
        return wav_bytes(samples_24k, OUTPUT_RATE), OUTPUT_RATE
    return float_to_pcm16(samples_24k).tobytes(), OUTPUT_RATE


def duration_ms(samples: int, rate: int) -> int:
    return int(math.floor(samples * 1000 / rate))
