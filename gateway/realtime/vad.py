"""Server voice-activity detection for ``turn_detection: {"type": "server_vad"}`` (docs/protocol.md, Realtime
session object).

Two detectors share one state machine; ``turn_detection.detector`` names the one a session uses:

* ``"silero"`` (default): the Silero VAD network (the ONNX file the ``silero-vad`` package ships, run
  through onnxruntime directly, one CPU thread). It scores 32 ms windows (512 samples at 16 kHz, plus
  the 64 samples before them as context) with a recurrent state carried from window to window, and
  tells speech from steady noise: white noise as loud as the speech (0 dB SNR) scores below 0.05.
* ``"energy"``: the fallback with no model file. 20 ms frames; the frame RMS in dBFS is mapped linearly
  from -60 dBFS (p = 0) to -20 dBFS (p = 1), so the default ``threshold`` 0.5 fires at -40 dBFS (RMS
  0.01). Energy is not speech: loud steady noise (fans, music) counts as speech and quiet speech is
  missed. It exists for deployments without onnxruntime and for tests built on synthetic tones.

Either way a frame is *voiced* when its speech probability ``p >= threshold`` (OpenAI's meaning of
``threshold``: a probability, higher = needs clearer speech).

State machine (all durations are audio time, not wall time, rounded up to whole frames):

* idle → speaking once ``min_speech_duration_ms`` of consecutive voiced frames were seen. The speech
  start is the first voiced frame of that run; the item audio begins ``prefix_padding_ms`` earlier
  (never before the end of the previous turn or the last reset);
* speaking → idle once ``silence_duration_ms`` of consecutive unvoiced frames were seen; the item audio
  ends at the end of that silence (it includes the silence, as OpenAI's ``audio_end_ms`` does).

The outcome depends only on the audio, never on how the client sized its appends: audio is cut into
frames on the detector's own clock.
"""

from __future__ import annotations

import importlib.util
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from onnxruntime import InferenceSession

SAMPLE_RATE = 16_000
FRAME_MS = 20  # the energy detector's frame
FRAME_SAMPLES = SAMPLE_RATE * FRAME_MS // 1000
FLOOR_DBFS = -60.0
CEIL_DBFS = -20.0
DETECTORS = ("silero", "energy")

# OpenAI's server_vad defaults (threshold, prefix padding, silence); the minimum speech run and the
# detector name are ours.
DEFAULTS: dict[str, Any] = {
    "type": "server_vad",
    "threshold": 0.5,
    "prefix_padding_ms": 300,
    "silence_duration_ms": 500,
    "min_speech_duration_ms": 250,
    "create_response": True,
    "interrupt_response": True,
    "detector": "silero",
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
        elif key == "detector":
            if value not in DETECTORS:
                raise ValueError(f"turn_detection.detector must be one of {list(DETECTORS)}")
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
        raise ValueError(
            "turn_detection.interrupt_response must be true: server VAD speech always interrupts"
        )
    return out


def speech_probability(frame: np.ndarray) -> float:
    """Frame energy mapped to [0, 1] (the energy detector's rule, see the module docstring)."""
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


class FrameVad:
    """Streaming detector: feed 16 kHz float audio in any chunk sizes, get boundary events back.

    Subclasses say how long a frame is and how a frame is scored. Sample positions are absolute: counted
    from the first sample this detector (or the one it replaced, via ``clock``) ever saw, which is the
    session's audio clock.
    """

    frame_samples = FRAME_SAMPLES

    def __init__(self, params: dict[str, Any], clock: int = 0, *, speaking: bool = False) -> None:
        frame_ms = self.frame_samples * 1000 / SAMPLE_RATE
        self.threshold = float(params["threshold"])
        self.prefix_samples = int(params["prefix_padding_ms"]) * SAMPLE_RATE // 1000
        self.min_speech_frames = max(1, math.ceil(int(params["min_speech_duration_ms"]) / frame_ms))
        self.silence_frames = max(1, math.ceil(int(params["silence_duration_ms"]) / frame_ms))
        self.clock = clock  # samples consumed so far (analysed or waiting in the partial frame)
        self._partial = np.zeros(0, dtype=np.float32)
        self.speaking = speaking
        self._run = 0  # consecutive voiced (idle) or unvoiced (speaking) frames
        self._run_start = 0  # first sample of the current voiced run
        self._floor = clock  # item audio never starts before this sample

    def score(self, frame: np.ndarray) -> float:
        """Speech probability of the next frame (``frame_samples`` long), in stream order."""
        raise NotImplementedError

    @property
    def history_samples(self) -> int:
        """How far back a speech start can reach: what a caller must keep of not-yet-speech audio."""
        return self.prefix_samples + (self.min_speech_frames + 2) * self.frame_samples

    def reset(self) -> None:
        """Forget the current state (input cleared or committed by the client); the clock keeps running.

        A model's recurrent state is kept: the audio stream itself goes on without a gap.
        """
        self._partial = np.zeros(0, dtype=np.float32)
        self.speaking = False
        self._run = 0
        self._floor = self.clock

    def process(self, samples: np.ndarray) -> list[VadEvent]:
        x = np.asarray(samples, dtype=np.float32).reshape(-1)
        n = self.frame_samples
        frame_end = self.clock - self._partial.size  # absolute start of the buffered partial frame
        self.clock += x.size
        buf = np.concatenate([self._partial, x]) if self._partial.size else x
        events: list[VadEvent] = []
        n_frames = buf.size // n
        for i in range(n_frames):
            frame_start = frame_end
            frame_end = frame_start + n
            voiced = self.score(buf[i * n : (i + 1) * n]) >= self.threshold
            event = self._step(voiced, frame_start, frame_end)
            if event is not None:
                events.append(event)
        self._partial = buf[n_frames * n :].copy()
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


class EnergyVad(FrameVad):
    """The frame-energy fallback (``detector: "energy"``): 20 ms frames, :func:`speech_probability`."""

    frame_samples = FRAME_SAMPLES

    def score(self, frame: np.ndarray) -> float:
        return speech_probability(frame)


# ---------------------------------------------------------------------------------------------- Silero

SILERO_WINDOW = 512  # samples per scored window at 16 kHz (the network's fixed input)
SILERO_CONTEXT = 64  # samples of the previous window prepended to each input
_SILERO_STATE_SHAPE = (2, 1, 128)
_silero_lock = threading.Lock()
_silero_session: Any = None


def silero_model_path() -> Path | None:
    """The ONNX file inside the installed ``silero-vad`` package, or ``None`` when it is not installed.

    Found through the import system without importing the package (its ``__init__`` imports torch).
    """
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "silero_vad.onnx"
    return path if path.is_file() else None


def silero_session() -> InferenceSession:
    """The process-wide onnxruntime session (loaded once, ~2 MB). ``run`` is thread-safe and the
    recurrent state is an explicit input, so every detector shares it. Raises ``RuntimeError`` when the
    model or onnxruntime is missing."""
    global _silero_session
    with _silero_lock:
        if _silero_session is None:
            path = silero_model_path()
            if path is None:
                raise RuntimeError("the silero-vad package (its ONNX model) is not installed")
            try:
                import onnxruntime as ort
            except ImportError as exc:  # pragma: no cover - onnxruntime is a declared dependency
                raise RuntimeError(f"onnxruntime is not importable: {exc}") from None
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = 1  # one window is ~0.3 ms: threads would cost more than they save
            opts.inter_op_num_threads = 1
            _silero_session = ort.InferenceSession(
                str(path), sess_options=opts, providers=["CPUExecutionProvider"]
            )
        return _silero_session


def silero_available() -> bool:
    """Whether ``detector: "silero"`` can be served here (the model loads)."""
    try:
        silero_session()
    except RuntimeError:
        return False
    return True


class SileroVad(FrameVad):
    """Silero VAD (``detector: "silero"``): one network step per 32 ms window, state carried across."""

    frame_samples = SILERO_WINDOW

    def __init__(self, params: dict[str, Any], clock: int = 0, *, speaking: bool = False) -> None:
        super().__init__(params, clock, speaking=speaking)
        self._session = silero_session()
        self._state = np.zeros(_SILERO_STATE_SHAPE, dtype=np.float32)
        self._context = np.zeros((1, SILERO_CONTEXT), dtype=np.float32)
        self._sr = np.array(SAMPLE_RATE, dtype=np.int64)

    def score(self, frame: np.ndarray) -> float:
        x = np.concatenate([self._context, frame.reshape(1, -1)], axis=1)
        prob, self._state = self._session.run(None, {"input": x, "state": self._state, "sr": self._sr})
        self._context = x[:, -SILERO_CONTEXT:]
        return float(prob[0, 0])


def make_detector(params: dict[str, Any], clock: int = 0, *, speaking: bool = False) -> FrameVad:
    """The detector ``params["detector"]`` names (normalised params)."""
    cls = SileroVad if params.get("detector", DEFAULTS["detector"]) == "silero" else EnergyVad
    return cls(params, clock, speaking=speaking)
