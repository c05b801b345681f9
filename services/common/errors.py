"""Typed stage errors: one exception type that maps to the proto ``Error`` with a stable code.

Engines and processors raise :class:`StageError`; the gRPC front turns it into an ``Error`` message on
the stream (never a free-text gRPC status alone), and the gateway maps codes to HTTP statuses.
"""

from __future__ import annotations

from typing import cast

from services.common.pb import common_pb2

ErrorCode = common_pb2.ErrorCode

INVALID_ARGUMENT = common_pb2.ERROR_CODE_INVALID_ARGUMENT
CONTEXT_LENGTH_EXCEEDED = common_pb2.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED
RESOURCE_EXHAUSTED = common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED
UNAVAILABLE = common_pb2.ERROR_CODE_UNAVAILABLE
INTERNAL = common_pb2.ERROR_CODE_INTERNAL
CANCELLED = common_pb2.ERROR_CODE_CANCELLED
DEADLINE_EXCEEDED = common_pb2.ERROR_CODE_DEADLINE_EXCEEDED
OUT_OF_ORDER = common_pb2.ERROR_CODE_OUT_OF_ORDER
UNSUPPORTED_MEDIA = common_pb2.ERROR_CODE_UNSUPPORTED_MEDIA
BAD_REFERENCE_AUDIO = common_pb2.ERROR_CODE_BAD_REFERENCE_AUDIO
FAILED_PRECONDITION = common_pb2.ERROR_CODE_FAILED_PRECONDITION

# Short stable names used in logs, metrics labels and the gateway's error envelope.
CODE_NAMES: dict[int, str] = {
    INVALID_ARGUMENT: "invalid_argument",
    CONTEXT_LENGTH_EXCEEDED: "context_length_exceeded",
    RESOURCE_EXHAUSTED: "resource_exhausted",
    UNAVAILABLE: "unavailable",
    INTERNAL: "internal",
    CANCELLED: "cancelled",
    DEADLINE_EXCEEDED: "deadline_exceeded",
    OUT_OF_ORDER: "out_of_order",
    UNSUPPORTED_MEDIA: "unsupported_media",
    BAD_REFERENCE_AUDIO: "bad_reference_audio",
    FAILED_PRECONDITION: "failed_precondition",
}


class StageError(Exception):
    """An error a stage reports to its caller with a stable code and, when known, the offending field."""

    def __init__(self, code: int, message: str, param: str = "") -> None:
        super().__init__(message)
        self.code = int(code)
        self.message = message
        self.param = param

    @property
    def code_name(self) -> str:
        return CODE_NAMES.get(self.code, "unknown")

    def to_proto(self, identity: common_pb2.Identity | None = None) -> common_pb2.Error:
        # The proto enum is a plain int at run time; the cast only tells the stubs so.
        err = common_pb2.Error(
            code=cast(common_pb2.ErrorCode, self.code), message=self.message, param=self.param
        )
        if identity is not None:
            err.id.CopyFrom(identity)
        return err

    @classmethod
    def from_proto(cls, err: common_pb2.Error) -> StageError:
        return cls(err.code, err.message, err.param)

    def __repr__(self) -> str:
        return f"StageError({self.code_name}, {self.message!r}, param={self.param!r})"
