"""The uncommitted user input of one realtime session (docs/protocol.md, Realtime commit and lanes).

Audio enters through :meth:`InputBuffer.push` (or :meth:`InputBuffer.push_speech` from server VAD), is
cut into 1 s units, and leaves as one user item on :meth:`InputBuffer.seal` or is dropped by
:meth:`InputBuffer.clear`. Owned by :class:`gateway.realtime.session.DuplexSession`.
"""

from __future__ import annotations

import numpy as np

from gateway.realtime.audio import UNIT_SAMPLES, AudioUnit, UnitAssembler


class InputBuffer:
    def __init__(self) -> None:
        self._assembler = UnitAssembler()
        self._units: list[AudioUnit] = []  # closed units of the uncommitted user item (turn lane)
        self.started = False  # audio was appended in this session (the voice can no longer change)
        self.clock = 0  # 16 kHz samples appended this session: the server-VAD audio clock
        self.has_audio = False
        self.has_speech = False

    @property
    def pending_samples(self) -> int:
        """Samples held here: the open partial unit plus the closed units not yet committed."""
        return self._assembler.pending_samples + UNIT_SAMPLES * len(self._units)

    def note_append(self, samples: int) -> None:
        """An append of ``samples`` arrived (whether or not it enters the buffer: server VAD may drop it)."""
        self.started = True
        self.clock += samples

    def push(self, samples: np.ndarray, frames: list[bytes], speech: bool) -> list[AudioUnit]:
        """Add audio; returns the units it closed (the caller sends them on or :meth:`hold`\\ s them)."""
        self.has_audio = True
        self.has_speech = self.has_speech or speech
        return self._assembler.push(samples, frames, speech)

    def push_speech(self, samples: np.ndarray, frames: list[bytes]) -> None:
        """Server VAD: speech audio enters the buffer and its closed units wait for the commit."""
        self.hold(self.push(samples, frames, True))

    def hold(self, units: list[AudioUnit]) -> None:
        self._units.extend(units)

    def flush(self) -> tuple[int, AudioUnit | None]:
        """Start a commit: (samples appended since the last one, the zero-padded residual unit or None)."""
        return self._assembler.total_samples, self._assembler.flush()

    def seal(self) -> list[AudioUnit]:
        """End a commit: hand over the held units and start an empty buffer."""
        units, self._units = self._units, []
        self._reset()
        return units

    def clear(self) -> None:
        """Drop the uncommitted input."""
        self._assembler.clear()
        self._units = []
        self._reset()

    def _reset(self) -> None:
        self._assembler.total_samples = 0
        self.has_audio = self.has_speech = False
