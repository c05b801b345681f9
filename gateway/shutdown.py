"""Graceful shutdown of the gateway process on SIGTERM / SIGINT (docs/reliability.md).

uvicorn's own shutdown closes the listening socket, waits up to ``timeout_graceful_shutdown`` for open
HTTP requests, and closes every WebSocket with 1012 at once. A realtime client would then see the socket
drop without the documented ``session.closed{reason:"server_shutdown"}``. :class:`GatewayServer` puts
one step in front: on the first signal the runtime stops admitting (chat requests get 503 with
``Retry-After``, ``/health`` says ``shutting_down`` so load balancers stop routing), every realtime session
is closed through its own close path (``session.closed{server_shutdown}``, close 1000), and only then does
uvicorn's shutdown start, which lets in-flight chat requests finish within the grace. A second signal
skips the wait. The process exits 0 (uvicorn would re-raise the signal, exiting 143).
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 10  # seconds (uvicorn takes an int); in-flight HTTP requests may finish within this
REALTIME_CLOSE_S = 3.0  # realtime sessions get this long to send session.closed


async def close_realtime_sessions(app: FastAPI, timeout_s: float = REALTIME_CLOSE_S) -> int:
    """Ask every realtime session to close with ``server_shutdown``; wait (bounded) until they are gone."""
    endpoint = getattr(app.state, "realtime", None)
    registry = getattr(endpoint, "registry", None)
    if registry is None:
        return 0
    sessions = list(registry.sessions.values())
    for session in sessions:
        session.post("close", "server_shutdown")
    deadline = time.monotonic() + timeout_s
    while registry.sessions and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if registry.sessions:
        log.warning("%d realtime session(s) did not close within %.1f s", len(registry.sessions), timeout_s)
    return len(sessions)


class GatewayServer(uvicorn.Server):
    """uvicorn server whose first exit signal drains the gateway before uvicorn's shutdown starts."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.gateway_app = app
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)
        self._captured_signals.clear()  # a graceful stop is a clean exit, not death by the signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self._loop is None or not self.started:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        log.info("shutdown requested: no new requests; closing realtime sessions, then draining HTTP")
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain(sig, frame)))  # type: ignore[union-attr]

    async def _drain(self, sig: int, frame: FrameType | None) -> None:
        runtime = getattr(self.gateway_app.state, "runtime", None)
        if runtime is not None:
            runtime.draining = True
        try:
            closed = await close_realtime_sessions(self.gateway_app)
            if closed:
                log.info("closed %d realtime session(s) with server_shutdown", closed)
        finally:
            super().handle_exit(sig, frame)
