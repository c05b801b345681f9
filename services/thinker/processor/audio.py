"""Audio input for the thinker: decoding, 16 kHz mono, Whisper log-mel with MiniCPM's normalisation.

Features (docs/model.md, Thinker inputs): 80 mel bins, n_fft 400, hop 160 (100 frames/s). Each piece of at
most 30 s is zero-padded to 30 s before the STFT (as the Whisper front end does, so the frames next to the end
and the dynamic floor are exactly the reference's), ``log10`` is floored at ``max - 8`` (the dynamic variant),
then scaled ``(x + 4) / 4``; only the ``ceil(samples / 160)`` frames that cover real audio are kept. Longer
audio is cut into 30 s pieces, each encoded separately; the placeholder count is the sum over pieces of
``pooled_length(frames)`` (10 per second).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from services.common.audio import AUDIO_DECODE_ERRORS, read_audio, resample
from services.thinker.errors import media_error
from services.thinker.model.audio import pooled_length

SAMPLE_RATE = 16_000
N_FFT = 400
HOP = 160
N_MELS = 80
PIECE_SECONDS = 30
PIECE_SAMPLES = PIECE_SECONDS * SAMPLE_RATE
DYNAMIC_RANGE_DB = 8.0
# The shortest clip that still yields one pooled embedding (9 mel frames -> 5 encoder frames -> 1 row).
MIN_SAMPLES = HOP * 8 + 1


@dataclass(frozen=True)
class AudioClip:
    """Raw samples at any rate (mono or ``[samples, channels]``); resampled to 16 kHz mono on use."""

    samples: np.ndarray
    sample_rate: int = SAMPLE_RATE


def decode_audio(data: object, param: str) -> np.ndarray:
    """Bytes (WAV/FLAC/OGG...), :class:`AudioClip` or a 16 kHz float array -> float32 mono 16 kHz."""
    if isinstance(data, AudioClip):
        samples, rate = np.asarray(data.samples), int(data.sample_rate)
    elif isinstance(data, np.ndarray):
        samples, rate = data, SAMPLE_RATE
    elif isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data)
        if not raw:
            raise media_error(param, "audio data is empty")
        try:
            samples, rate = read_audio(raw)
        except AUDIO_DECODE_ERRORS as exc:
            raise media_error(param, f"cannot decode audio ({exc.__class__.__name__}: {exc})") from exc
    else:
        raise media_error(param, f"unsupported audio input type {type(data).__name__}")
    samples = np.asarray(samples)
    if samples.ndim == 2:
        samples = samples.mean(axis=1)
    if samples.ndim != 1:
        raise media_error(
            param, f"audio must be mono or [samples, channels] (got shape {list(samples.shape)})"
        )
    if not np.issubdtype(samples.dtype, np.floating):
        if np.issubdtype(samples.dtype, np.integer):
            samples = samples.astype(np.float32) / float(
                -np.iinfo(samples.dtype).min or np.iinfo(samples.dtype).max
            )
        else:
            raise media_error(param, f"audio samples have unsupported dtype {samples.dtype}")
    samples = samples.astype(np.float32, copy=False)
    if not np.all(np.isfinite(samples)):
        raise media_error(param, "audio contains NaN or infinite samples")
    if rate <= 0:
        raise media_error(param, f"invalid sample rate {rate}")
    # soxr HQ, the resampler of upstream's ``librosa.load(path, sr=16000)`` (librosa's default res_type),
    # which is how upstream's examples bring audio at other rates to the processor's 16 kHz.
    samples = resample(samples, rate, SAMPLE_RATE)
    if samples.shape[0] < MIN_SAMPLES:
        raise media_error(
            param, f"audio is too short ({samples.shape[0]} samples at 16 kHz, need {MIN_SAMPLES})"
        )
    return samples


@lru_cache(maxsize=1)
def _mel_filters() -> torch.Tensor:
    from transformers.audio_utils import mel_filter_bank

    bank = mel_filter_bank(
        num_frequency_bins=1 + N_FFT // 2,
        num_mel_filters=N_MELS,
        min_frequency=0.0,
        max_frequency=8000.0,
        sampling_rate=SAMPLE_RATE,
        norm="slaney",
        mel_scale="slaney",
    )
    return torch.from_numpy(np.asarray(bank)).to(torch.float32).T.contiguous()  # [n_mels, n_freq]


def frames_for(samples: int) -> int:
    """Mel frames kept for a piece of ``samples`` samples (frames whose hop start lies in the audio)."""
    return math.ceil(samples / HOP)


def split_pieces(audio: np.ndarray) -> list[np.ndarray]:
    """Cut audio into consecutive pieces of at most 30 s (the Whisper position table's span)."""
    return [audio[i : i + PIECE_SAMPLES] for i in range(0, len(audio), PIECE_SAMPLES)] or [audio]


def log_mel(piece: np.ndarray) -> torch.Tensor:
    """One <= 30 s piece of 16 kHz audio -> ``[80, ceil(len / 160)]`` normalised log-mel (float32)."""
    if len(piece) > PIECE_SAMPLES:
        raise ValueError("log_mel takes pieces of at most 30 s; use split_pieces first")
    wave = torch.zeros(PIECE_SAMPLES, dtype=torch.float32)
    wave[: len(piece)] = torch.from_numpy(np.ascontiguousarray(piece, dtype=np.float32))
    spec = torch.stft(
        wave[None], n_fft=N_FFT, hop_length=HOP, window=torch.hann_window(N_FFT), return_complex=True
    )
    power = spec[..., :-1].abs() ** 2
    mel = _mel_filters() @ power  # [1, 80, 3000]
    logm = torch.clamp(mel, min=1e-10).log10()
    logm = torch.maximum(logm, logm.max() - DYNAMIC_RANGE_DB)
    logm = (logm + 4.0) / 4.0
    return logm[0, :, : frames_for(len(piece))]


def audio_embed_count(num_samples: int, pool_step: int) -> int:
    """Audio embeddings (= ``<unk>`` placeholders) for a clip of ``num_samples`` 16 kHz samples."""
    total = 0
    for start in range(0, max(num_samples, 1), PIECE_SAMPLES):
        piece = min(PIECE_SAMPLES, num_samples - start)
        total += int(pooled_length(frames_for(piece), pool_step))
    return total


def audio_placeholder(count: int, per_second_groups: bool = False) -> str:
    """``<|audio_start|>`` + count x ``<unk>`` + ``<|audio_end|>``; optionally one group per 10 rows."""
    if not per_second_groups:
        return "<|audio_start|>" + "<unk>" * count + "<|audio_end|>"
    groups = [min(10, count - i) for i in range(0, count, 10)]
    return "".join("<|audio_start|>" + "<unk>" * g + "<|audio_end|>" for g in groups)


@dataclass
class MelUnit:
    """One streamed unit: ``mel`` [80, frames] (100 for 1 s) and the next frames the convolutions peek at."""

    mel: torch.Tensor
    lookahead: torch.Tensor | None


class StreamingLogMel:
    """Per-session log-mel for duplex: push 16 kHz samples, get whole 1 s units (100 frames) out.

    Frame ``t`` is computed from samples ``[160 t - 200, 160 t + 200)`` of the stream (the start is
    reflect-padded, as the offline STFT does), so every emitted frame equals the offline frame of the
    whole stream up to the floor rule. The floor follows upstream's streaming processor: none (only the
    1e-10 clamp) until ``dynamic_after_s`` seconds have been heard, then ``running max - 8``. A unit is
    released once its ``lookahead_frames`` next frames are computable too (the encoder's convolutions
    read one frame ahead: pass ``unit.lookahead`` to ``ThinkerModel.get_audio_embeds_streaming``).
    """

    def __init__(
        self, unit_frames: int = 100, lookahead_frames: int = 2, dynamic_after_s: float = 5.0
    ) -> None:
        if unit_frames % 2:
            raise ValueError("unit_frames must be even (encoder stride 2)")
        self.unit_frames = unit_frames
        self.lookahead_frames = lookahead_frames
        self.dynamic_after_s = dynamic_after_s
        self.reset()

    def reset(self) -> None:
        self._padded = np.zeros(0, dtype=np.float32)  # reflect-padded stream, from global frame _base on
        self._base = 0  # global frame index of _padded[0] (frame t starts at padded sample 160 t)
        self._next = 0  # next frame to emit
        self._heard = 0  # samples pushed so far
        self._started = False
        self._pending: list[np.ndarray] = []
        self._max = -np.inf

    def _frames(self, start: int, count: int) -> torch.Tensor:
        offset = (start - self._base) * HOP
        seg = torch.from_numpy(self._padded[offset : offset + (count - 1) * HOP + N_FFT].copy())
        spec = torch.stft(
            seg,
            n_fft=N_FFT,
            hop_length=HOP,
            window=torch.hann_window(N_FFT),
            center=False,
            return_complex=True,
        )
        logm = torch.clamp(_mel_filters() @ (spec.abs() ** 2), min=1e-10).log10()
        self._max = max(self._max, float(logm.max()))
        if self._heard >= self.dynamic_after_s * SAMPLE_RATE:
            logm = torch.maximum(logm, torch.tensor(self._max - DYNAMIC_RANGE_DB))
        return (logm + 4.0) / 4.0

    def push(self, samples: np.ndarray) -> list[MelUnit]:
        """Append samples; return every unit that became complete (often none or one)."""
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        self._heard += samples.shape[0]
        if not self._started:
            self._pending.append(samples)
            head = np.concatenate(self._pending)
            if head.shape[0] <= N_FFT // 2:
                return []
            self._pending = []
            self._started = True
            samples = np.concatenate([head[1 : N_FFT // 2 + 1][::-1], head])
        self._padded = np.concatenate([self._padded, samples])
        units: list[MelUnit] = []
        while True:
            need = self.unit_frames + self.lookahead_frames
            available = (self._padded.shape[0] - N_FFT) // HOP + 1 + self._base  # frames fully computable
            if available - self._next < need:
                break
            frames = self._frames(self._next, need)
            units.append(
                MelUnit(
                    frames[:, : self.unit_frames],
                    frames[:, self.unit_frames :] if self.lookahead_frames else None,
                )
            )
            self._next += self.unit_frames
            drop = self._next - self._base  # keep the samples of frames not yet emitted
            self._padded = self._padded[drop * HOP :]
            self._base = self._next
        return units

    def flush(self) -> MelUnit | None:
        """End of stream: the remaining frames (even count, zero right padding as offline), or None."""
        if not self._started:
            return None
        count = frames_for(self._heard) - self._next  # offline keeps ceil(samples / 160) frames
        count -= count % 2
        if count <= 0:
            return None
        self._padded = np.concatenate([self._padded, np.zeros(N_FFT, dtype=np.float32)])
        frames = self._frames(self._next, count)
        self._next += count
        self._padded = np.zeros(0, dtype=np.float32)
        return MelUnit(frames, None)
