"""``speed`` for ``/v1/audio/speech``: a pitch-preserving time stretch of the 24 kHz output.

FFmpeg's ``atempo`` filter (through PyAV) changes tempo without changing pitch; one instance takes
factors in [0.5, 100], so factors below 0.5 chain two instances (0.25 = 0.5 x 0.5). The stretcher is
streaming: each :meth:`TimeStretch.push` returns the stretched audio ready so far and :meth:`flush` the
rest, so a streamed response stays streamed. ``speed == 1`` bypasses the filter entirely.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np

MIN_SPEED, MAX_SPEED = 0.25, 4.0


def atempo_chain(speed: float) -> list[float]:
    """``speed`` as a product of factors each inside ``atempo``'s [0.5, 100] range."""
    factors: list[float] = []
    rest = speed
    while rest < 0.5:
        factors.append(0.5)
        rest /= 0.5
    factors.append(rest)
    assert math.isclose(math.prod(factors), speed)
    return factors


class TimeStretch:
    """Streaming tempo change of mono float32 audio at ``sample_rate``."""

    def __init__(self, speed: float, sample_rate: int) -> None:
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise ValueError(f"speed must be in [{MIN_SPEED}, {MAX_SPEED}]")
        self.speed = speed
        self.sample_rate = sample_rate
        self._graph: Any = None
        self._pts = 0
        if speed != 1.0:
            import av.filter

            graph = av.filter.Graph()
            src = graph.add_abuffer(
                format="flt", sample_rate=sample_rate, layout="mono", time_base=Fraction(1, sample_rate)
            )
            node = src
            for factor in atempo_chain(speed):
                nxt = graph.add("atempo", f"{factor:.6f}")
                node.link_to(nxt)
                node = nxt
            sink = graph.add("abuffersink")
            node.link_to(sink)
            graph.configure()
            self._graph = graph

    def push(self, samples: np.ndarray) -> np.ndarray:
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        if self._graph is None or samples.size == 0:
            return samples
        import av

        frame = av.AudioFrame.from_ndarray(samples[None, :], format="flt", layout="mono")
        frame.sample_rate = self.sample_rate
        frame.pts = self._pts
        self._pts += samples.size
        self._graph.push(frame)
        return self._pull()

    def flush(self) -> np.ndarray:
        if self._graph is None:
            return np.zeros(0, np.float32)
        self._graph.push(None)
        out = self._pull()
        self._graph = None
        return out

    def _pull(self) -> np.ndarray:
        import av

        pieces: list[np.ndarray] = []
        while True:
            try:
                frame = self._graph.pull()
            except (av.BlockingIOError, av.EOFError):
                break
            pieces.append(frame.to_ndarray().reshape(-1).astype(np.float32))
        return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
