"""One socket's view of a session, and the resume-token hash that lets a new socket take it over
(docs/protocol.md, Realtime session end)."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

CLOSE = object()  # outbound sentinel: close the socket after draining


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Attachment:
    """One socket's view of a session: an outbound queue drained by the socket's writer task."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.close_code: int | None = None
        self.detached = False

    def send(self, event: dict[str, Any]) -> None:
        if not self.detached:
            self.queue.put_nowait(event)

    def close(self, code: int = 1000) -> None:
        if not self.detached:
            self.detached = True
            self.close_code = code
            self.queue.put_nowait(CLOSE)
