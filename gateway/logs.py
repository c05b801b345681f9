"""Structured logs of the gateway and the launcher: one JSON object per line, the request id on each.

Every record becomes ``{"ts", "level", "logger", "msg", "request_id"?, "exc"?}`` on one line. JSON
escapes whatever a client managed to put into a message (newlines, control characters, quotes), so a
log line can never be forged or split by request content. ``request_id`` is the id of the request (or
realtime session) the logging code runs for: the HTTP middleware and the realtime socket handler set it
in a context variable (:func:`bind_request_id`), which asyncio copies into every task the request
starts, so a line logged deep in the pipeline, or by uvicorn about that request, carries it too.

What is logged at the default level (``info``) never includes request content (messages, media, audio)
or secrets (the API key is never logged at any level).
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Any, TextIO

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("minicpmo_request_id", default=None)


def bind_request_id(request_id: str | None) -> contextvars.Token[str | None]:
    """Make ``request_id`` the id of every log line of the current context (and the tasks it starts)."""
    return REQUEST_ID.set(request_id)


def current_request_id() -> str | None:
    return REQUEST_ID.get()


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def __init__(self, process: str | None = None) -> None:
        super().__init__()
        self.process_name = process

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if self.process_name:
            out["process"] = self.process_name
        request_id = getattr(record, "request_id", None) or REQUEST_ID.get()
        if request_id:
            out["request_id"] = request_id
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return json.dumps(out, ensure_ascii=False, default=str)


def configure(level: str = "info", process: str | None = None, stream: TextIO | None = None) -> None:
    """Route every logger (uvicorn's included: pass ``log_config=None`` to uvicorn) through one JSON
    handler on stderr; replaces whatever handlers the root logger had."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(process))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
