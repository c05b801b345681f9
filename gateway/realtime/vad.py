"""Server voice-activity detection for ``turn_detection: {"type": "server_vad"}`` (wire-protocol §4.3, §4.9).

The detector is a deliberately simple, deterministic frame-energy VAD: no model weights, no randomness,
and the same audio always yields the same boundaries whatever the append sizes were.

Rule, per 20 ms frame of 16 kHz mono audio:

* level = RMS of the frame in dBFS (full scale = 1.0);
* speech probability ``p = clip((level - FLOOR_DBFS) / (CEIL_DBFS - FLOOR_DBFS), 0, 1)``, i.e. a linear
  map from -60 dBFS (p = 0) to -20 dBFS (p = 1); the default ``threshold`` 0.5 therefore fires at
  -40 dBFS (RMS 0.01), ``threshold`` 1.0 needs -20 dBFS;
* a frame is *voiced* when ``p >= threshold``.

State machine (all durations are audio time, not wall time):

* idle → speaking once ``min_speech_duration_ms`` of consecutive voiced frames were seen. The speech
  start is the first voiced frame of that run; the item audio begins ``prefix_padding_ms`` earlier
  (never before the end of the previous turn or the last reset);
* speaking → idle once ``silence_duration_ms`` of consecutive unvoiced frames were seen; the item audio
  ends at the end of that silence (it includes the silence, as OpenAI's ``audio_end_ms`` does).

Limits, by design: energy is not speech. Loud steady noise (fans, music, a TV) counts as speech, and
speech quieter than the threshold level (a distant microphone at -45 dBFS) is missed; there is no
noise-floor adaptation, so the threshold is an absolute level. A client in a noisy room should raise
``threshold`` or use client-side VAD with ``turn_detection: null``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

SAMPLE_RATE = 16_000
FRAME_MS = 20
FRAME_SAMPLES = SAMPLE_RATE * FRAME_MS // 1000
FLOOR_DBFS = -60.0
CEIL_DBFS = -20.0

# OpenAI's server_vad defaults (threshold, prefix padding, silence); the minimum speech run is ours.
DEFAULTS: dict[str, Any] = {
    "type": "server_vad",
    "threshold": 0.5,
    "prefix_padding_ms": 300,
    "silence_duration_ms": 500,
    "min_speech_duration_ms": 250,
    "create_response": True,
    "interrupt_response": True,
}
# Accepted ranges of the duration fields, in ms (inclusive).
_DURATION_RANGES = {
    "prefix_padding_ms": (0, 5_000),
    "silence_duration_ms": (FRAME_MS, 10_000),
    "min_speech_duration_ms": (0, 5_000),
}


def normalize_server_vad(spec: dict[str, Any]) -> dict[str, Any]:
    """Validate a ``server_vad`` object and return it with every default filled in.

    Raises ``ValueError`` with a client-facing message; the caller maps it to the error code the
    protocol wants on that path (``invalid_session_config`` on open, ``unsupported_turn_detection`` later).
    """
    unknown = sorted(set(spec) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown turn_detection keys: {unknown}")
    out = dict(DEFAULTS)
    for key, value in spec.items():
        if key == "type" or value is None:
            continue
        if key in ("create_response", "interrupt_response"):
            if not isinstance(value, bool):
                raise ValueError(f"turn_detection.{key} must be a boolean")
            out[key] = value
        elif key == "threshold":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
                raise ValueError("turn_detection.threshold must be a number in (0, 1]")
            out[key] = float(value)
        else:
            lo, hi = _DURATION_RANGES[key]
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or (isinstance(value, float) and not value.is_integer())
                or not lo <= value <= hi
            ):
                raise ValueError(f"turn_detection.{key} must be an integer number of ms in [{lo}, {hi}]")
            out[key] = int(value)
    if out["interrupt_response"] is not True:
        raise ValueError("turn_detection.interrupt_response must be true: server VAD speech always interrupts")
    return out


def speech_probability(frame: np.ndarray) -> float:
    """Frame energy mapped to [0, 1] (see the module docstring for the rule)."""
    rms = float(np.sqrt(np.mean(np.square(frame, dtype=np.float64)))) if frame.size else 0.0
    if rms <= 0.0:
        return 0.0
    level = 20.0 * math.log10(rms)
    return min(1.0, max(0.0, (level - FLOOR_DBFS) / (CEIL_DBFS - FLOOR_DBFS)))


@dataclass(frozen=True)
class SpeechStarted:
    speech_sample: int  # first sample of the first voiced frame of the run
    start_sample: int  # where the user item's audio begins (prefix padding applied)
    at_sample: int  # the end of the frame that confirmed the start

    @property
    def audio_start_ms(self) -> int:
        return self.start_sample * 1000 // SAMPLE_RATE


@dataclass(frozen=True)
class SpeechStopped:
    end_sample: int  # end of the silence window that closed the turn

    @property
    def audio_end_ms(self) -> int:
        return self.end_sample * 1000 // SAMPLE_RATE

    @property
    def at_sample(self) -> int:
        return self.end_sample


VadEvent = SpeechStarted | SpeechStopped


class EnergyVad:
    """Streaming detector: feed 16 kHz float audio in any chunk sizes, get boundary events back.

    Sample positions are absolute: counted from the first sample this detector (or the one it replaced,
    via ``clock``) ever saw, which is the session's audio clock.
    """

    def __init__(self, params: dict[str, Any], clock: int = 0, *, speaking: bool = False) -> None:
        self.threshold = float(params["threshold"])
        self.prefix_samples = int(params["prefix_padding_ms"]) * SAMPLE_RATE // 1000
        self.min_speech_frames = max(1, math.ceil(int(params["min_speech_duration_ms"]) / FRAME_MS))
        self.silence_frames = max(1, math.ceil(int(params["silence_duration_ms"]) / FRAME_MS))
        self.clock = clock  # samples consumed so far (analysed or waiting in the partial frame)
        self._partial = np.zeros(0, dtype=np.float32)
        self.speaking = speaking
        self._run = 0  # consecutive voiced (idle) or unvoiced (speaking) frames
        self._run_start = 0  # first sample of the current voiced run
        self._floor = clock  # item audio never starts before this sample

    @property
    def history_samples(self) -> int:
        """How far back a speech start can reach: what a caller must keep of not-yet-speech audio."""
        return self.prefix_samples + (self.min_speech_frames + 2) * FRAME_SAMPLES

    def reset(self) -> None:
        """Forget the current state (input cleared or committed by the client); the clock keeps running."""
        self._partial = np.zeros(0, dtype=np.float32)
        self.speaking = False
        self._run = 0
        self._floor = self.clock

    def process(self, samples: np.ndarray) -> list[VadEvent]:
        x = np.asarray(samples, dtype=np.float32).reshape(-1)
        frame_end = self.clock - self._partial.size  # absolute start of the buffered partial frame
        self.clock += x.size
        buf = np.concatenate([self._partial, x]) if self._partial.size else x
        events: list[VadEvent] = []
        n_frames = buf.size // FRAME_SAMPLES
        for i in range(n_frames):
            frame = buf[i * FRAME_SAMPLES : (i + 1) * FRAME_SAMPLES]
            frame_start = frame_end
            frame_end = frame_start + FRAME_SAMPLES
            voiced = speech_probability(frame) >= self.threshold
            event = self._step(voiced, frame_start, frame_end)
            if event is not None:
                events.append(event)
        self._partial = buf[n_frames * FRAME_SAMPLES :].copy()
        return events

    def _step(self, voiced: bool, frame_start: int, frame_end: int) -> VadEvent | None:
        if not self.speaking:
            if not voiced:
                self._run = 0
                return None
            if self._run == 0:
                self._run_start = frame_start
            self._run += 1
            if self._run < self.min_speech_frames:
                return None
            self.speaking, self._run = True, 0
            start = max(self._floor, self._run_start - self.prefix_samples)
            return SpeechStarted(speech_sample=self._run_start, start_sample=start, at_sample=frame_end)
        if voiced:
            self._run = 0
            return None
        self._run += 1
        if self._run < self.silence_frames:
            return None
        self.speaking, self._run = False, 0
        self._floor = frame_end
        return SpeechStopped(end_sample=frame_end)
