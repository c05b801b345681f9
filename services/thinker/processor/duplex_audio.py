"""The duplex audio front end (docs/model.md, Duplex): 1 s units in, the mel chunk each unit hands Whisper
out.

This follows upstream's duplex path number for number (``MiniCPMODuplex.streaming_prefill`` with its
"exact" streaming mel processor), because the streamed mel is what the model was trained to hear:

* **Unit buffer.** The first unit is left-padded with zeros to 1035 ms, and 1030 ms of it (1035 ms
  rounded down to the 10 ms hop) are consumed; every later unit consumes 1000 ms. So the stream the mel
  sees is ``zeros(560) ++ audio`` and 80 samples carry from each unit into the next.
* **Mel.** Every unit appends its samples to a buffer of the whole stream (slid by 10 s once it reaches
  30 s) and recomputes the log-mel of the whole buffer (centred STFT, reflect-padded at both ends of the
  buffer, last frame dropped). A unit emits its 100 new frames plus 2 frames on each side (none on the left
  for the first unit), so 102 frames, then 104. Those frames lie at least half a window inside the buffer,
  so only the floor depends on what else the buffer holds.
* **Floor.** While the buffer is shorter than 5 s, ``log10`` is floored at -10 (no stronger than the
  1e-10 clamp); from 5 s on at the maximum over the whole buffer's mel minus 8, the frames not yet
  emitted included. The floor is re-read every unit, so the 2 frames a unit shares with the previous one
  can differ from what that unit saw: they are passed to Whisper as recomputed (``lookbehind``).

Computing that literally means one STFT over up to 30 s per unit (:func:`buffer_log_mel`, the reference
the tests hold the stream to). The stream gets the same numbers incrementally instead: a frame whose
window lies inside the buffer never changes, so only the unit's frames, the frames next to either end of
the buffer (reflect-padded) and the per-frame maxima the floor needs are computed, about 105 frames a unit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.thinker.processor.audio import HOP, N_FFT, SAMPLE_RATE, _mel_filters

FIRST_UNIT_MS = 1035
UNIT_MS = 1000
REDUNDANCY_FRAMES = 2  # 20 ms on each side of a unit's core frames
SLIDE_TRIGGER_S = 30.0
SLIDE_STRIDE_S = 10.0
DYNAMIC_AFTER_S = 5.0
DYNAMIC_RANGE_DB = 8.0
FIXED_FLOOR = -10.0


@dataclass
class DuplexMelChunk:
    """One unit's mel ``[80, prefix + core + suffix]`` and how many frames on each side are context."""

    mel: torch.Tensor
    prefix_frames: int
    suffix_frames: int

    @property
    def lookbehind(self) -> torch.Tensor:
        return self.mel[:, : self.prefix_frames]

    @property
    def core(self) -> torch.Tensor:
        return self.mel[:, self.prefix_frames : self.mel.shape[1] - self.suffix_frames]

    @property
    def lookahead(self) -> torch.Tensor:
        return self.mel[:, self.mel.shape[1] - self.suffix_frames :]


def log10_frames(buffer: np.ndarray, first: int, count: int) -> torch.Tensor:
    """Clamped ``log10`` mel ``[80, count]`` of frames ``first ..`` of the buffer's centred STFT (unfloored).

    Frame ``j`` reads samples ``[160 j - 200, 160 j + 200)``, reflected at both ends of the buffer as the
    centred STFT pads, so these are exactly the columns of the whole-buffer mel.
    """
    length = buffer.shape[0]
    idx = np.arange(HOP * first - N_FFT // 2, HOP * (first + count - 1) + N_FFT // 2)
    idx = np.abs(idx)
    idx = np.where(idx >= length, 2 * (length - 1) - idx, idx)
    seg = torch.from_numpy(np.ascontiguousarray(buffer[idx], dtype=np.float32))
    spec = torch.stft(
        seg, n_fft=N_FFT, hop_length=HOP, window=torch.hann_window(N_FFT), center=False, return_complex=True
    )
    return torch.clamp(_mel_filters() @ (spec.abs() ** 2), min=1e-10).log10()


def _floored(logm: torch.Tensor, buffer_len: int, buffer_max: float | torch.Tensor) -> torch.Tensor:
    if buffer_len < DYNAMIC_AFTER_S * SAMPLE_RATE:
        floor = torch.tensor(FIXED_FLOOR, dtype=logm.dtype)
    else:
        floor = torch.as_tensor(buffer_max, dtype=logm.dtype) - DYNAMIC_RANGE_DB
    return (torch.maximum(logm, floor) + 4.0) / 4.0


def buffer_log_mel(buffer: np.ndarray) -> torch.Tensor:
    """Whisper log-mel of a whole buffer ``[80, len // 160]`` with the duplex floor rule (see module doc)."""
    wave = torch.from_numpy(np.ascontiguousarray(buffer, dtype=np.float32))[None]
    spec = torch.stft(wave, n_fft=N_FFT, hop_length=HOP, window=torch.hann_window(N_FFT), return_complex=True)
    logm = torch.clamp(_mel_filters() @ (spec[..., :-1].abs() ** 2), min=1e-10).log10()[0]
    return _floored(logm, buffer.shape[0], logm.max())


class DuplexAudioStream:
    """Per-session state of the duplex audio front end: :meth:`push` one unit, get its mel chunk."""

    def __init__(self) -> None:
        self.first_samples = int(
            FIRST_UNIT_MS * SAMPLE_RATE / 1000
        )  # 16560: what the first unit is padded to
        # 16480: the first chunk the mel consumes, 1035 ms rounded down to the hop
        self.first_chunk = max(HOP, (int(round(FIRST_UNIT_MS * SAMPLE_RATE / 1000)) // HOP) * HOP)
        self.unit_chunk = int(round(UNIT_MS * SAMPLE_RATE / 1000))
        self.reset()

    def reset(self) -> None:
        self._pending = np.zeros(0, dtype=np.float32)  # unit samples not consumed yet (the 80-sample carry)
        self._buffer = np.zeros(0, dtype=np.float32)  # what the mel is computed over
        self._base_frame = 0  # global frame index of the buffer's first frame
        self._emitted = 0  # global frame index after the last emitted core frame
        self._frame_max: dict[int, float] = {}  # global frame -> max over its bins, frames inside the buffer
        self.units = 0

    def push(self, samples: np.ndarray) -> DuplexMelChunk | None:
        """Append one unit of 16 kHz samples; the unit's mel chunk, or None when too little audio came."""
        first = self.units == 0
        pending = np.concatenate([self._pending, np.asarray(samples, dtype=np.float32).reshape(-1)])
        if first and pending.shape[0] < self.first_samples:
            # Matches upstream: the first unit is left-padded to 1035 ms, of which only 1030 ms are used,
            # so 80 samples (5 ms + the padding's excess) carry into every later unit.
            pad = np.zeros(self.first_samples - pending.shape[0], dtype=np.float32)
            pending = np.concatenate([pad, pending])
        need = self.first_chunk if first else self.unit_chunk
        if pending.shape[0] < need:
            self._pending = pending
            return None
        self._pending = pending[need:]
        self._append(pending[:need])
        length = self._buffer.shape[0]
        frames = length // HOP  # the centred STFT's frames minus the last one, as upstream drops it
        interior_last = (length - N_FFT // 2) // HOP  # the last frame whose window ends inside the buffer
        core_start, core_end = self._emitted, self._emitted + self.unit_chunk // HOP
        if min(frames, interior_last + 1) + self._base_frame < core_end + REDUNDANCY_FRAMES:
            return None  # cannot happen with whole units; upstream reports the unit as failed
        start = min(max(0, core_start - REDUNDANCY_FRAMES - self._base_frame), frames)
        end = min(max(start, core_end + REDUNDANCY_FRAMES - self._base_frame), frames)
        region = log10_frames(self._buffer, start, frames - start)  # the unit's frames and the right edge
        maxima = region.max(dim=0).values
        for i in range(frames - start):
            j = start + i
            if 2 <= j <= interior_last:  # a frame no later push or slide changes
                self._frame_max[self._base_frame + j] = float(maxima[i])
        edges = [float(maxima[interior_last + 1 - start :].max())] if frames > interior_last + 1 else []
        if start > 0:  # the frames next to the buffer's left end (reflect-padded there)
            edges.append(float(log10_frames(self._buffer, 0, min(2, frames)).max()))
        buffer_max = max(edges + list(self._frame_max.values()))
        self._emitted = core_end
        self.units += 1
        mel = _floored(region[:, : end - start], length, buffer_max)
        # Matches upstream: the prefix is declared as 0 frames for the first unit and 2 afterwards.
        return DuplexMelChunk(mel.contiguous(), 0 if first else REDUNDANCY_FRAMES, REDUNDANCY_FRAMES)

    def _append(self, chunk: np.ndarray) -> None:
        self._buffer = np.concatenate([self._buffer, chunk])
        length = self._buffer.shape[0]
        if length < SLIDE_TRIGGER_S * SAMPLE_RATE:
            return
        # Upstream's trigger-mode slide: drop 10 s from the left, keep at least 1 s, hop aligned.
        drop = int(SLIDE_STRIDE_S * SAMPLE_RATE)
        guard = min(SAMPLE_RATE, length - drop)
        drop = min(drop, max(0, length - guard))
        drop = (drop // HOP) * HOP
        if drop > 0:
            self._buffer = self._buffer[drop:]
            self._base_frame += drop // HOP
            # frames that left the buffer, and the new first two (now reflect-padded), leave the max
            self._frame_max = {g: v for g, v in self._frame_max.items() if g >= self._base_frame + 2}
