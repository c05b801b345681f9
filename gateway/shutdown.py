"""Graceful drain of the gateway process on SIGTERM / SIGINT (docs/reliability.md, "Drain").

uvicorn's own shutdown closes the listening socket, waits up to ``timeout_graceful_shutdown`` for open
HTTP requests, then cuts whatever is still open, and closes every WebSocket with 1012 at once: a client
would see its stream end bare. :class:`GatewayServer` drains first, on the first signal:

1. the runtime stops admitting: chat requests get 503 with ``Retry-After``, ``/health`` says
   ``shutting_down`` (so load balancers stop routing), new realtime sockets are refused;
2. in-flight chat requests and realtime responses may finish within the grace (``--drain-grace``,
   profile ``gateway.drain_grace_s``, default 30 s); a realtime session is closed with
   ``session.closed{server_shutdown}`` as soon as it has no response running;
3. when the grace runs out, every chat run still going gets a final SSE ``error`` event
   (``server_shutdown``) and ``[DONE]`` (a non-streaming one a 503), and every realtime session still
   open ``session.closed{server_shutdown}``;
4. only then does uvicorn's shutdown start, which has nothing left to cut.

A second signal skips the wait. The process exits 0 (uvicorn would re-raise the signal, exiting 143).
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from gateway.openai.errors import APIError

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger(__name__)

# uvicorn's own wait after the drain: only the last bytes of the streams ended in step 3 are left.
GRACEFUL_SHUTDOWN_S = 5
FINAL_FLUSH_S = 3.0  # how long step 3 waits for the ended streams and sessions to say goodbye
POLL_S = 0.05


def shutdown_error() -> APIError:
    """What a chat request still running when the grace ends gets (its final SSE ``error`` event)."""
    return APIError(
        503,
        "the server is shutting down; the request was ended before it finished, retry it",
        None,
        headers={"Retry-After": "3"},
        code="server_shutdown",
    )


def _sessions(app: FastAPI) -> dict[str, Any]:
    """The live realtime sessions (empty without the realtime routes); new ones are refused from now on."""
    endpoint = getattr(app.state, "realtime", None)
    registry = getattr(endpoint, "registry", None)
    if registry is None:
        return {}
    registry.draining = True
    sessions: dict[str, Any] = registry.sessions
    return sessions


def _busy(session: Any) -> bool:
    """A realtime session with a response running (or asked for): the drain lets it finish."""
    lifecycle = session.lifecycle
    return lifecycle.active is not None or lifecycle.deferred_create


async def drain(app: FastAPI, grace_s: float) -> dict[str, int]:
    """Steps 1-3 of the module docstring; returns what happened (for the log and the tests)."""
    runtime = getattr(app.state, "runtime", None)
    if runtime is not None:
        runtime.draining = True
    sessions = _sessions(app)
    closing: set[str] = set()
    deadline = time.monotonic() + grace_s
    while True:
        for sid, session in list(sessions.items()):
            if sid not in closing and not _busy(session):
                closing.add(sid)
                session.post("close", "server_shutdown")
        in_flight = runtime.in_flight if runtime is not None else 0
        if not in_flight and not sessions:
            return {"chat_cut": 0, "realtime_cut": 0, "realtime_closed": len(closing)}
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(POLL_S)
    chat_cut = runtime.pipeline.end_all(shutdown_error()) if runtime is not None else 0
    realtime_cut = 0
    for sid, session in list(sessions.items()):
        if sid not in closing:
            realtime_cut += 1
            closing.add(sid)
            session.post("close", "server_shutdown")
    log.warning(
        "drain grace of %.0f s over: ending %d chat request(s) and %d realtime session(s)",
        grace_s,
        chat_cut,
        realtime_cut,
    )
    flush_deadline = time.monotonic() + FINAL_FLUSH_S
    while (sessions or (runtime is not None and runtime.in_flight)) and time.monotonic() < flush_deadline:
        await asyncio.sleep(POLL_S)
    return {"chat_cut": chat_cut, "realtime_cut": realtime_cut, "realtime_closed": len(closing)}


class GatewayServer(uvicorn.Server):
    """uvicorn server whose first exit signal drains the gateway before uvicorn's shutdown starts."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, grace_s: float = 30.0) -> None:
        super().__init__(config)
        self.gateway_app = app
        self.grace_s = grace_s
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
        log.info("shutdown requested: admitting nothing new; draining for up to %.0f s", self.grace_s)
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain(sig, frame)))  # type: ignore[union-attr]

    async def _drain(self, sig: int, frame: FrameType | None) -> None:
        try:
            outcome = await drain(self.gateway_app, self.grace_s)
            log.info("drained: %s", outcome)
        finally:
            super().handle_exit(sig, frame)
