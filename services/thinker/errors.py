"""Typed thinker input errors.

:class:`ProcessorError` is a :class:`~services.common.errors.StageError`, so the gRPC front sends it as a
proto ``Error`` with a stable code and the offending field (``param``), and the gateway maps it to a 4xx.
"""

from __future__ import annotations

import torch

from services.common.errors import (
    INTERNAL,
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    UNSUPPORTED_MEDIA,
    StageError,
)


class ProcessorError(StageError):
    """A request the processor cannot turn into a prompt (bad media, too many items, reserved tokens)."""

    def __init__(self, param: str, message: str, code: int = INVALID_ARGUMENT) -> None:
        super().__init__(code, message, param)


def media_error(param: str, message: str) -> ProcessorError:
    """Undecodable or unsupported image/audio/video bytes."""
    return ProcessorError(param, message, UNSUPPORTED_MEDIA)


def failure(what: str, exc: BaseException) -> StageError:
    """A typed error for an unexpected failure: device out of memory is ``RESOURCE_EXHAUSTED`` (the client
    may retry later or send less), anything else ``INTERNAL``. The message names the step that failed."""
    if isinstance(exc, torch.OutOfMemoryError):
        return StageError(RESOURCE_EXHAUSTED, f"{what}: the thinker ran out of device memory; retry later")
    return StageError(INTERNAL, f"{what}: {type(exc).__name__}: {exc}")
