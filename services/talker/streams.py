"""Per-stream state of the Talker engine and the plain messages it emits (the server maps them to protos).

A stream is one gRPC ``Generate`` call. It carries a sequence of conditions (Thinker chunks or duplex
units) and emits codec windows. Everything a stream owns (slot, penalty history, draw counter, window buffer,
previous segment for recompute) lives here, so closing the stream frees all of it.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.common.errors import StageError
from services.talker.sampling import DuplexBudget, RowState, SamplingParams
from services.talker.windows import CodecWindower, Window


class TurnForm(enum.Enum):
    """How a turn's conditions arrive; decided by its first chunk (see docs/talker.md)."""

    WHOLE = "whole"  # first chunk is also the last: upstream _generate_speech_non_streaming
    STREAMING = "streaming"  # several chunks: upstream TTSStreamingGenerator
    DUPLEX = "duplex"  # one chunk per 1 s unit: upstream duplex generate_chunk


class Phase(enum.Enum):
    IDLE = "idle"  # waiting for a condition
    DECODE = "decode"  # has a frame to feed in the next batched step
    CLOSED = "closed"


@dataclass(frozen=True)
class StreamSettings:
    """What a TalkerOpen fixes for the stream's lifetime."""

    request_id: str
    session_id: str
    duplex: bool
    sampling: SamplingParams
    min_new_frames: int
    max_new_frames: int
    fixed_frames: int  # 0: off; >0: exactly this many frames, EOS ignored (benchmarks)
    window_frames: int
    left_context: int
    first_window_frames: int


@dataclass
class ConditionInput:
    """One TalkerChunk as the engine sees it."""

    token_ids: torch.Tensor
    hidden: torch.Tensor
    is_last: bool
    turn_end: bool
    epoch: int
    turn_id: int
    unit_seq: int


# ------------------------------------------------------------------------------------------- outputs
@dataclass(frozen=True)
class OutMeta:
    epoch: int
    turn_id: int
    unit_seq: int
    chunk_seq: int


@dataclass(frozen=True)
class WindowOut:
    meta: OutMeta
    window: Window


@dataclass(frozen=True)
class DoneOut:
    meta: OutMeta
    finish_reason: str  # stop | length | interrupted | cancelled | error
    frames: int
    condition_rows: int


@dataclass(frozen=True)
class ErrorOut:
    meta: OutMeta
    error: StageError


@dataclass(frozen=True)
class InterruptAckOut:
    meta: OutMeta
    new_epoch: int
    dropped_items: int


@dataclass(frozen=True)
class ClosedOut:
    """The engine will send nothing more on this stream."""

    meta: OutMeta


Output = WindowOut | DoneOut | ErrorOut | InterruptAckOut | ClosedOut


@dataclass
class StreamState:
    settings: StreamSettings
    emit: Callable[[Output], None]
    epoch: int = 0
    turn_id: int = 0
    unit_seq: int = 0
    out_seq: int = 0
    slot: int | None = None
    phase: Phase = Phase.IDLE
    queue: deque[ConditionInput] = field(default_factory=deque)
    fixed_parts: list[ConditionInput] = field(default_factory=list)  # fixed_frames: chunks gathered
    # Turn mode: the turn ended on its frame budget before its last chunk arrived; chunks up to and
    # including that last one are dropped (they belong to a finished turn).
    skip_to_last: bool = False
    ending: bool = False  # Control End received: finish current work, then Done and close
    turns_finished: int = 0
    session_frames: int = 0
    session_condition_rows: int = 0

    # ---- turn state (reset by a new turn, an interrupt or a turn end)
    form: TurnForm | None = None
    row: RowState | None = None
    windower: CodecWindower | None = None
    turn_frames: int = 0
    turn_condition_rows: int = 0
    turn_segments: int = 0
    text_finished: bool = False

    # ---- current segment (a streaming chunk, a duplex unit or the whole utterance)
    seg_condition: torch.Tensor | None = None
    seg_frames: list[int] = field(default_factory=list)
    seg_t: int = 0
    seg_is_last: bool = False
    seg_turn_end: bool = False
    seg_budget: DuplexBudget | None = None
    pending_code: int | None = None  # last kept frame, fed at the next decode step

    # ---- previous segment, for sliding recompute and rollover
    prev_condition: torch.Tensor | None = None
    prev_frames: list[int] = field(default_factory=list)

    def meta(self) -> OutMeta:
        m = OutMeta(self.epoch, self.turn_id, self.unit_seq, self.out_seq)
        self.out_seq += 1
        return m

    def new_turn(self, turn_id: int) -> None:
        s = self.settings
        self.turn_id = turn_id
        self.form = None
        self.row = RowState(s.sampling)
        self.windower = CodecWindower(s.window_frames, s.left_context, s.first_window_frames)
        self.turn_frames = 0
        self.turn_condition_rows = 0
        self.turn_segments = 0
        self.text_finished = False
        self.seg_condition = None
        self.seg_frames = []
        self.seg_t = 0
        self.seg_is_last = False
        self.seg_turn_end = False
        self.seg_budget = None
        self.pending_code = None
        self.prev_condition = None
        self.prev_frames = []

    @property
    def in_turn(self) -> bool:
        return self.form is not None
