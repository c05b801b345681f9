"""WebSocket routes ``/v1/realtime`` (``?duplex=1``) and ``/v1/duplex`` (docs/protocol.md, Realtime
handshake).

The socket side of a session is deliberately thin: one reader that turns frames into mailbox entries
(with the frame-size, JSON and idle checks that need no session state) and one writer that drains the
attachment's outbound queue. All semantics live in :mod:`gateway.realtime.session`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect, WebSocketState

from gateway.auth import check_api_key
from gateway.openai.body import loads_checked
from gateway.openai.errors import APIError
from gateway.realtime import events as ev
from gateway.realtime.attachment import CLOSE, Attachment, hash_token
from gateway.realtime.config import parse_session
from gateway.realtime.errors import RealtimeError
from gateway.realtime.pipeline.events import PipelineFactory
from gateway.realtime.registry import SessionRegistry
from gateway.realtime.session import DuplexSession
from gateway.realtime.settings import RealtimeSettings

log = logging.getLogger(__name__)

_DUPLEX_ON = {"1", "true", "on"}
POLICY_VIOLATION = 1008


def _error_frame(exc: RealtimeError) -> dict[str, Any]:
    return {"type": "error", "event_id": ev.new_event_id(), "error": exc.body()}


def _parse_frame(text: str, max_bytes: int) -> dict[str, Any]:
    if len(text.encode("utf-8")) > max_bytes:
        raise RealtimeError("event_too_large", f"frame exceeds {max_bytes} bytes")
    try:
        event = loads_checked(text.encode("utf-8", "surrogatepass"))
    except APIError as exc:  # not JSON, too deep, a NaN / Infinity (named by its path), a lone surrogate
        code = "invalid_json" if exc.code == "invalid_json" else "invalid_value"
        raise RealtimeError(code, f"frame: {exc.message}", param=exc.param) from exc
    if not isinstance(event, dict):
        raise RealtimeError("bad_event", "frame must be a JSON object")
    if not isinstance(event.get("type"), str):
        raise RealtimeError(
            "bad_event", "event needs a string type", param="type", event_id=_client_id(event)
        )
    return event


def _client_id(event: dict[str, Any]) -> str | None:
    value = event.get("event_id")
    return value if isinstance(value, str) else None


class RealtimeEndpoint:
    def __init__(self, settings: RealtimeSettings, pipeline_factory: PipelineFactory) -> None:
        self.settings = settings
        self.registry = SessionRegistry(settings, pipeline_factory)

    async def _handshake_fail(self, ws: WebSocket, exc: RealtimeError) -> None:
        with contextlib.suppress(Exception):
            await ws.send_json(_error_frame(exc))
            await ws.close(POLICY_VIOLATION)

    async def _receive_text(self, ws: WebSocket, timeout: float) -> str | None:
        """Next text frame; None on disconnect. Binary frames are answered as bad events by the caller."""
        message = await asyncio.wait_for(ws.receive(), timeout)
        if message["type"] == "websocket.disconnect":
            return None
        text: str | None = message.get("text")
        if text is not None:
            return text
        return ""  # binary frame

    def _authorized(self, ws: WebSocket) -> bool:
        """The gateway's API key (if configured) guards the socket too: ``Authorization: Bearer <key>``."""
        config = getattr(ws.app.state, "config", None)
        if config is None or not getattr(config, "api_key", None):
            return True
        return check_api_key(config, ws.headers.get("authorization"))

    async def serve(self, ws: WebSocket) -> None:
        await ws.accept()
        if not self._authorized(ws):
            await self._handshake_fail(ws, RealtimeError("invalid_api_key", "invalid or missing API key"))
            return
        params = ws.query_params
        autostart = params.get("autostart") != "0" and params.get("resume") != "1"
        session: DuplexSession | None = None
        attachment: Attachment | None = None
        first: dict[str, Any] | None = None
        try:
            if params.get("model") and autostart:
                session = self.registry.open(
                    parse_session({"model": params["model"]}, voices=self.settings.voice_lookup)
                )
                attachment = session.attach_new()
            else:
                try:
                    text = await self._receive_text(ws, self.settings.config_timeout_s)
                except TimeoutError:
                    raise RealtimeError(
                        "config_timeout", "no session.update within the configuration timeout"
                    ) from None
                if text is None:
                    return
                if text == "":
                    raise RealtimeError("bad_event", "binary frames are not accepted")
                first = _parse_frame(text, self.settings.max_frame_bytes)
                kind = first["type"]
                if kind == "session.resume":
                    session, attachment = await self._resume(first)
                    first = None
                else:
                    obj = first.get("session") if kind == "session.update" else {}
                    try:
                        cfg = parse_session(obj, voices=self.settings.voice_lookup)
                    except RealtimeError as exc:
                        exc.event_id = exc.event_id or _client_id(first)
                        raise
                    session = self.registry.open(cfg)
                    attachment = session.attach_new()
                    if kind == "session.update":
                        first = None
        except RealtimeError as exc:
            if first is not None and exc.event_id is None:
                exc.event_id = _client_id(first)
            await self._handshake_fail(ws, exc)
            return
        except WebSocketDisconnect:
            return
        if first is not None:
            session.post("client", (first, 0))
        await self._pump(ws, session, attachment)

    async def _resume(self, event: dict[str, Any]) -> tuple[DuplexSession, Attachment]:
        session, last = self.registry.lookup_for_resume(event)
        attachment = Attachment(session.generation + 1)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        session.post("attach", (attachment, last, hash_token(event["resume_token"]), done))
        try:
            await asyncio.wait_for(done, 10.0)
        except TimeoutError:
            raise RealtimeError("runtime_resume_failed", "the session did not accept the resume") from None
        return session, attachment

    async def _pump(self, ws: WebSocket, session: DuplexSession, attachment: Attachment) -> None:
        writer = asyncio.create_task(self._write(ws, session, attachment))
        reader = asyncio.create_task(self._read(ws, session, attachment))
        try:
            await asyncio.wait({writer, reader}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Whatever ended the socket (client gone, idle, handler cancelled by the server), a socket
            # the session still counts as attached is detached: the session waits for a resume.
            if not attachment.detached:
                ended_by = "writer" if writer.done() else "reader"
                log.info(
                    "realtime session %s: socket ended (%s side) without session end; detaching",
                    session.id,
                    ended_by,
                )
                session.post("detach", attachment)
                attachment.detached = True
                attachment.queue.put_nowait(CLOSE)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(writer, 5.0)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            if (
                ws.application_state == WebSocketState.CONNECTED
                and ws.client_state == WebSocketState.CONNECTED
            ):
                with contextlib.suppress(Exception):
                    await ws.close(1000)  # idle timeout: end the socket; the session waits for a resume

    async def _write(self, ws: WebSocket, session: DuplexSession, attachment: Attachment) -> None:
        """Drain the attachment's queue onto the socket until CLOSE.

        An event that cannot be encoded is a server bug: it is logged with its type and replaced by an
        ``internal_error`` event, and the writer carries on, because ending the writer detaches the
        socket and silently drops every later event (``session.closed`` included). A failed send means
        the socket is gone; that ends the writer, with a log line that names the event it lost.
        """
        while True:
            item = await attachment.queue.get()
            if item is CLOSE:
                if ws.application_state == WebSocketState.CONNECTED and attachment.close_code is not None:
                    with contextlib.suppress(Exception):
                        await ws.close(attachment.close_code)
                return
            try:
                text = ev.encode_event(item)
            except (TypeError, ValueError, RecursionError):
                log.exception("realtime session %s: cannot encode a %s event", session.id, item.get("type"))
                text = ev.encode_event(
                    _error_frame(RealtimeError("internal_error", f"could not encode {item.get('type')}"))
                )
            try:
                await ws.send_text(text)
            except Exception as exc:  # noqa: BLE001 - the socket is gone, however it failed
                log.info(
                    "realtime session %s: socket send failed at %s (%s: %s); detaching",
                    session.id,
                    item.get("type"),
                    type(exc).__name__,
                    exc,
                )
                return

    async def _read(self, ws: WebSocket, session: DuplexSession, attachment: Attachment) -> None:
        while not attachment.detached:
            try:
                text = await self._receive_text(ws, session.cfg.idle_timeout_s)
            except TimeoutError:
                log.info(
                    "realtime session %s idle for %.0f s: detaching", session.id, session.cfg.idle_timeout_s
                )
                return
            except (WebSocketDisconnect, RuntimeError):
                return
            if text is None:
                return
            try:
                if text == "":
                    raise RealtimeError("bad_event", "binary frames are not accepted")
                event = _parse_frame(text, self.settings.max_frame_bytes)
                size = len(text)
                if event["type"] in ("input_audio_buffer.append", "conversation.item.create"):
                    if not session.reserve_input_bytes(size):
                        raise RealtimeError(
                            "input_backpressure",
                            "pending input exceeds the session limit",
                            event_id=_client_id(event),
                        )
                else:
                    size = 0
            except RealtimeError as exc:
                session.post("reject", exc)
                continue
            session.post("client", (event, size))


def create_realtime_router(
    settings: RealtimeSettings | None = None,
    pipeline_factory: PipelineFactory | None = None,
) -> APIRouter:
    """Router with both realtime routes; ``router.realtime`` exposes the endpoint (registry, settings)."""
    settings = settings or RealtimeSettings()
    if pipeline_factory is None:
        from gateway.realtime.pipeline.duplex import grpc_pipeline_factory  # stage clients only when needed

        pipeline_factory = grpc_pipeline_factory(settings)
    endpoint = RealtimeEndpoint(settings, pipeline_factory)
    router = APIRouter()

    @router.websocket("/v1/realtime")
    async def realtime(ws: WebSocket) -> None:
        duplex = ws.query_params.get("duplex")
        if duplex is not None and duplex.lower() not in _DUPLEX_ON:
            await ws.accept()
            await ws.send_json(
                {"type": "error", "error": "Realtime API is not available", "code": "unsupported"}
            )
            await ws.close(POLICY_VIOLATION)
            return
        await endpoint.serve(ws)

    @router.websocket("/v1/duplex")
    async def duplex(ws: WebSocket) -> None:
        await endpoint.serve(ws)

    router.realtime = endpoint  # type: ignore[attr-defined]
    return router
