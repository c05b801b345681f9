"""What the session's parts may use of the session: the members ``DuplexSession`` offers its components.

The session owns its state and builds its parts (the response lifecycle, server VAD, the command
handlers); those parts call back into it. Naming ``DuplexSession`` in their annotations would make every
part import the session that imports it, an import cycle even when only the type checker follows it. So
each part names a protocol instead: :class:`SessionCore` here holds what all of them use, and each part
extends it with what only it needs (``lifecycle.LifecycleHost``, ``server_vad.VadHost``,
``commands.CommandHost``). ``DuplexSession`` satisfies them structurally; the type checker verifies that
where the session hands itself to a part.
"""

from __future__ import annotations

from typing import Any, Protocol

from gateway.realtime.audio import AudioUnit
from gateway.realtime.config import SessionConfig
from gateway.realtime.conversation import Conversation, UserItem
from gateway.realtime.errors import RealtimeError
from gateway.realtime.input_buffer import InputBuffer
from gateway.realtime.settings import RealtimeSettings


class SessionCore(Protocol):
    """The session members every part reads: identity, configuration, epoch, turn, input and events."""

    id: str
    settings: RealtimeSettings
    input: InputBuffer
    conversation: Conversation

    @property
    def cfg(self) -> SessionConfig: ...

    @property
    def epoch(self) -> int: ...

    @property
    def turn_id(self) -> int: ...

    @property
    def committed_backlog(self) -> tuple[UserItem, ...]: ...

    def emit(self, type_: str, *, journaled: bool = True, **fields: Any) -> dict[str, Any]: ...

    def emit_error(self, exc: RealtimeError) -> None: ...

    def emit_listen(
        self, reason: str, *, unit_seq: int | None = None, response_id: str | None = None
    ) -> None: ...

    def interrupt(self, reason: str, *, cleared: bool = False) -> None: ...

    def seal_input(
        self, *, create: bool, speech: bool, item_id: str | None = None, final: bool = False
    ) -> None: ...

    def pending_commits(self) -> int: ...

    def accept_units(self, units: list[AudioUnit]) -> None: ...

    async def end(self, reason: str, *, terminal_type: str = "session.closed") -> None: ...
