"""Realtime error envelope (docs/protocol.md, Realtime errors): stable codes, and the error type derived from
each code.

Clients switch on ``error.code``; ``error.type`` is a pure function of the code so that the two never
disagree (invariant W12).
"""

from __future__ import annotations

from typing import Any

SERVER_ERROR_CODES = frozenset(
    {
        "internal_error",
        "engine_error",
        "commit_aborted",
        "server_vad_unavailable",
        "runtime_append",
        "runtime_append_task",
        "runtime_signal",
        "runtime_abort",
        "runtime_data_plane_stream",
        "runtime_data_plane_text_without_audio",
        "runtime_touch",
        "stage_unavailable",
    }
)
RATE_LIMIT_CODES = frozenset({"resource_exhausted", "input_backpressure"})


def error_type_for(code: str) -> str:
    """The OpenAI-style error type of a stable code; unknown codes are client errors."""
    if code in SERVER_ERROR_CODES or code.startswith("runtime_"):
        return "server_error"
    if code in RATE_LIMIT_CODES:
        return "rate_limit_error"
    return "invalid_request_error"


class RealtimeError(Exception):
    """A rejected client event or a failed session operation, rendered as one ``error`` event."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        param: str | None = None,
        event_id: str | None = None,
        retryable: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.event_id = event_id
        self.retryable = retryable

    def body(self) -> dict[str, Any]:
        """The ``error`` object of the envelope (without the outer ``type``/``event_id``)."""
        out: dict[str, Any] = {"type": error_type_for(self.code), "code": self.code, "message": self.message}
        if self.event_id is not None:
            out["event_id"] = self.event_id
        if self.param is not None:
            out["param"] = self.param
        retryable = self.retryable
        if retryable is None and error_type_for(self.code) == "server_error":
            retryable = False
        if retryable is None and self.code == "resource_exhausted":
            retryable = True
        if retryable is not None:
            out["retryable"] = retryable
        return out
