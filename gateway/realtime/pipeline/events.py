"""What a realtime session and its stage pipeline tell each other.

The session drives a pipeline through :class:`SessionPipeline`; the pipeline answers only by posting
:data:`PipelineEvent` values through :meth:`PipelineHost.post_pipeline`, which queues them on the
session's mailbox, so they are handled in order with client commands. The pipeline never changes the
session: :class:`PipelineHost` is all it sees (the session's id, configuration, turn and the current
epoch, which only the session advances).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import numpy as np

from gateway.realtime.config import SessionConfig
from gateway.realtime.response_options import ResponseOptions


class UnitRole(Enum):
    """Why a unit goes to the thinker, which decides what the model may do at it (the ThinkerUnit flags)."""

    PLAIN = "plain"  # input or the native lane's silence clock: the model decides
    REQUEST = "request"  # turn lane: the unit that asks for the response (request_response: speak)
    LISTEN = "listen"  # turn lane: committed audio before the requesting unit (force_listen)
    CONTINUE = "continue"  # turn lane: a look-ahead silent unit that may only continue the model's turn


@dataclass
class UnitOutcome:
    """The thinker's decision on one unit of input."""

    epoch: int
    unit_seq: int
    decision: str  # "speak" | "listen"
    transcript: str
    turn_end: bool
    context_tokens: int  # the session's context after this unit (its input and its output fed)
    speech_turn: int = 0  # the pipeline's speaking turn this unit's speech went to (0: none)
    output_tokens: int = 0  # tokens the thinker generated on this unit
    context_before: int = 0  # the session's context when the unit was fed (held in its KV: cached input)
    max_tokens_reached: bool = False  # the turn ended because it spent its max_output_tokens budget
    tool_call: str = ""  # the function call the model made on this unit (<tool_call> block text), if any
    tool_call_truncated: bool = False  # the call was cut by the thinker's per-call token cap
    tool_error: str = ""  # the unit's tool grammar did not compile in the thinker (decided without tools)


@dataclass
class AudioOut:
    """24 kHz audio of one speaking turn (``is_last`` closes the turn's audio)."""

    epoch: int
    samples: np.ndarray  # float32 mono 24 kHz
    is_last: bool
    speech_turn: int = 0


@dataclass
class StageAck:
    """A stage acknowledged ``Control.interrupt(new_epoch)``."""

    stage: str
    new_epoch: int
    dropped: int


@dataclass
class PipelineFailure:
    """A stage stream of the session failed; reported once per failed stream.

    ``stage == "thinker"`` means the session's model state (the thinker's duplex KV) is gone and the
    session cannot go on; a talker or code2wav failure loses only the voice of one speaking turn
    (``epoch`` is that turn's epoch).
    """

    code: str
    message: str
    stage: str = ""
    epoch: int = field(default=0)


PipelineEvent = UnitOutcome | AudioOut | StageAck | PipelineFailure


class PipelineHost(Protocol):
    """The session as its pipeline sees it: read-only state and one way to report."""

    @property
    def id(self) -> str: ...

    @property
    def cfg(self) -> SessionConfig: ...

    @property
    def turn_id(self) -> int: ...

    @property
    def epoch(self) -> int:
        """The current epoch; outputs stamped with an older one are fenced."""
        ...

    def post_pipeline(self, event: PipelineEvent) -> None:
        """Queue ``event`` for the session's mailbox loop (never handled re-entrantly)."""
        ...


class SessionPipeline(Protocol):
    """What a session asks of its stage plumbing (the gRPC pipeline, or a scripted one in tests)."""

    def push_unit(
        self,
        samples: np.ndarray,
        frames: list[bytes],
        unit_seq: int,
        epoch: int,
        turn_id: int,
        role: UnitRole = UnitRole.PLAIN,
    ) -> None: ...

    def begin_response(self, options: ResponseOptions) -> None:
        """Options of the response the next ``REQUEST`` unit asks for (voiced or text only, a system note,
        a token budget, function tools); the voice and tool choices last until that response's speech ends
        or an interrupt."""
        ...

    def add_tool_output(self, output: str) -> None:
        """A function result from the client: it goes to the model right before the next unit."""
        ...

    def allow_speech_from(self, unit_seq: int, first_unit_of_request: int) -> None: ...

    def end_speech(self, epoch: int, speech_turn: int = 0) -> None: ...

    def interrupt(self, new_epoch: int, reason: str) -> None:
        """Fence every live stage stream at ``new_epoch`` (the session has already advanced to it)."""
        ...

    async def close(self) -> None: ...


PipelineFactory = Callable[[PipelineHost], SessionPipeline]
