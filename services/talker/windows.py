"""Framing of codec frames into the windows Code2Wav consumes (docs/model.md, Talker streaming and budgets).

Upstream (``MiniCPMO.streaming_generate``) keeps a buffer that starts as three silence ids (4218) and
hands Token2wav ``buffer[:25 + 3]`` whenever 28 ids are there, then drops the 25 vocalised ones, so every
window carries 3 frames of left context (the flow's pre-lookahead) followed by 25 new frames. When the
stream ends whatever is left (the context plus any remainder) goes out as the last window.

Here the same rule is a small state machine per stream and turn:

* ``left_context`` (3) frames of context, the very first ones being silence padding;
* ``window_frames`` (25) new frames per window;
* an optional smaller ``first_window_frames`` so the first audio leaves sooner (time to first audio);
* :meth:`finish` always emits exactly one ``is_last`` window (possibly context only, which is what
  upstream's final flush sends when the frames ended on a window boundary) so Code2Wav flushes its
  vocoder hold-back;
* :meth:`flush_partial` mirrors upstream duplex's turn-start ``force_flush``: emit what is buffered once
  at least ``min_new`` new frames are there, so a sub-second first unit is heard.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.checkpoint import CODEC_SILENCE_ID

DEFAULT_WINDOW_FRAMES = 25
DEFAULT_LEFT_CONTEXT = 3
FORCE_FLUSH_MIN_NEW = 5


@dataclass(frozen=True)
class Window:
    codes: list[int]
    left_context: int
    is_last: bool

    @property
    def new_frames(self) -> int:
        return len(self.codes) - self.left_context


class CodecWindower:
    """Turns a stream of frames into Code2Wav windows (one instance per turn)."""

    def __init__(
        self,
        window_frames: int = DEFAULT_WINDOW_FRAMES,
        left_context: int = DEFAULT_LEFT_CONTEXT,
        first_window_frames: int = 0,
        silence_id: int = CODEC_SILENCE_ID,
    ) -> None:
        if window_frames <= 0:
            raise ValueError("window_frames must be positive")
        if left_context < 0:
            raise ValueError("left_context must be ≥ 0")
        self.window_frames = window_frames
        self.left_context = left_context
        self.first_window_frames = first_window_frames if first_window_frames > 0 else window_frames
        self._buffer: list[int] = [silence_id] * left_context
        self._context = left_context  # how many ids at the head of the buffer were already vocalised
        self._emitted = 0
        self._finished = False

    @property
    def pending_new_frames(self) -> int:
        return len(self._buffer) - self._context

    def _next_size(self) -> int:
        return self.first_window_frames if self._emitted == 0 else self.window_frames

    def _take(self, new: int, is_last: bool) -> Window:
        end = self._context + new
        window = Window(list(self._buffer[:end]), self._context, is_last)
        keep_from = max(0, end - self.left_context)
        self._buffer = self._buffer[keep_from:]
        self._context = min(self.left_context, end)
        self._emitted += 1
        return window

    def push(self, frames: list[int]) -> list[Window]:
        """Add frames; return every full window they complete."""
        if self._finished:
            raise RuntimeError("push after finish")
        self._buffer.extend(int(f) for f in frames)
        out: list[Window] = []
        while self.pending_new_frames >= self._next_size():
            out.append(self._take(self._next_size(), is_last=False))
        return out

    def flush_partial(self, min_new: int = FORCE_FLUSH_MIN_NEW) -> list[Window]:
        """Emit buffered frames early (not last) when at least ``min_new`` new frames wait."""
        if self.pending_new_frames >= max(1, min_new):
            return [self._take(self.pending_new_frames, is_last=False)]
        return []

    def finish(self) -> Window:
        """The stream (or duplex turn) ended: one last window with the context and any remainder."""
        if self._finished:
            raise RuntimeError("finish called twice")
        self._finished = True
        return self._take(self.pending_new_frames, is_last=True)
