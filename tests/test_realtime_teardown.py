"""A realtime session always ends with ``session.closed``, whatever its pipeline or its events do.

No stage runs here: the gateway app (uvicorn on loopback) gets a scripted pipeline through
``app.state.realtime_pipeline_factory``, which can hang or fail on close, or report outputs carrying
numpy values. The socket writer is also driven directly with events JSON cannot hold. Each case is one
that once left a client waiting for a ``session.closed`` that never came, or could have.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from gateway_server import serve_in_thread
from realtime_helpers import QuietPipeline, pcm16_b64, session_body, tone
from starlette.websockets import WebSocketState
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.realtime.attachment import CLOSE, Attachment
from gateway.realtime.pipeline.events import UnitOutcome, UnitRole
from gateway.realtime.routes import RealtimeEndpoint
from gateway.realtime.session import DuplexSession
from gateway.realtime.settings import RealtimeSettings

CLOSE_BOUND_S = 0.5


class ScriptedPipeline(QuietPipeline):
    """A pipeline whose ``close`` hangs, raises or returns; in the native lane every unit is answered
    with a listen decision whose numbers are numpy scalars (as model code hands them out)."""

    def __init__(self, session: DuplexSession, close_mode: str) -> None:
        self.session = session
        self.close_mode = close_mode
        self.closed = False

    def push_unit(
        self,
        samples: np.ndarray,
        frames: list[bytes],
        unit_seq: int,
        epoch: int,
        turn_id: int,
        role: UnitRole = UnitRole.PLAIN,
    ) -> None:
        self.session.post_pipeline(UnitOutcome(epoch, np.int64(unit_seq), "listen", "", False, np.int32(13)))

    async def close(self) -> None:
        self.closed = True
        if self.close_mode == "hang":
            await asyncio.Event().wait()
        elif self.close_mode == "raise":
            raise RuntimeError("stage plumbing exploded")


@pytest.fixture()
def gateway(request: pytest.FixtureRequest) -> Iterator[str]:
    close_mode: str = getattr(request, "param", "ok")
    app = create_app(GatewayConfig(stage_addrs={s: "127.0.0.1:1" for s in ("thinker", "talker", "code2wav")}))
    app.state.realtime_settings.pipeline_close_timeout_s = CLOSE_BOUND_S
    app.state.realtime_pipeline_factory = lambda session: ScriptedPipeline(session, close_mode)
    with serve_in_thread(app) as port:
        yield f"ws://127.0.0.1:{port}/v1/realtime"


def _until(
    ws: ClientConnection, type_: str, timeout: float = 10.0
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []
    end = time.monotonic() + timeout
    while True:
        event = json.loads(ws.recv(timeout=max(0.01, end - time.monotonic())))
        seen.append(event)
        if event["type"] == type_:
            return event, seen


@pytest.mark.parametrize("gateway", ["hang", "raise"], indirect=True)
def test_session_close_is_answered_when_the_pipeline_close_hangs_or_fails(gateway: str) -> None:
    with connect(gateway, open_timeout=10) as ws:
        ws.send(json.dumps({"type": "session.update", "session": session_body()}))
        _until(ws, "session.updated")
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.2))}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit", "response_create": True}))
        _until(ws, "response.created")
        start = time.monotonic()
        ws.send(json.dumps({"type": "session.close"}))
        closed, _ = _until(ws, "session.closed", timeout=CLOSE_BOUND_S + 5)
        assert closed["reason"] == "client_close"
        assert time.monotonic() - start < CLOSE_BOUND_S + 3
        with pytest.raises(ConnectionClosed) as info:  # the server closes the socket after session.closed
            ws.recv(timeout=5)
        assert info.value.rcvd is None or info.value.rcvd.code == 1000


def test_numpy_values_in_pipeline_outputs_reach_the_client(gateway: str) -> None:
    """A numpy scalar in an event once made the journal's JSON encoding fail (an internal_error in its
    place); in the socket writer it would have detached the socket and dropped every later event."""
    with connect(gateway, open_timeout=10) as ws:
        ws.send(
            json.dumps(
                {"type": "session.update", "session": session_body(extra_body={"auto_response": True})}
            )
        )
        _until(ws, "session.updated")
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.0))}))
        listen, seen = _until(ws, "response.listen")
        assert listen["response"]["metadata"] == {"reason": "model_listen", "unit_seq": 0}
        assert not [e for e in seen if e["type"] == "error"]
        ws.send(json.dumps({"type": "session.close"}))
        assert _until(ws, "session.closed")[0]["reason"] == "client_close"


class _RecordingSocket:
    """The part of a starlette WebSocket the writer uses."""

    application_state = WebSocketState.CONNECTED

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.closed_with: int | None = None

    async def send_text(self, text: str) -> None:
        self.sent.append(json.loads(text))

    async def close(self, code: int = 1000) -> None:
        self.closed_with = code


class _SessionStub:
    id = "duplex-" + "0" * 32


def test_writer_survives_an_event_it_cannot_encode() -> None:
    """An unencodable event is replaced by internal_error; the events behind it, session.closed among
    them, still go out and the socket is closed as asked."""
    endpoint = RealtimeEndpoint(RealtimeSettings(), lambda session: None)
    ws = _RecordingSocket()
    attachment = Attachment(1)
    attachment.send({"type": "response.output_audio.delta", "event_id": "event_1", "delta": object()})
    attachment.send(
        {"type": "response.output_audio.delta", "event_id": "event_2", "sample_rate_hz": np.int64(24000)}
    )
    attachment.send({"type": "session.closed", "event_id": "event_3", "reason": "client_close"})
    attachment.close(1000)
    assert attachment.queue.qsize() == 4 and CLOSE in list(attachment.queue._queue)  # type: ignore[attr-defined]
    asyncio.run(asyncio.wait_for(endpoint._write(ws, _SessionStub(), attachment), 5))  # type: ignore[arg-type]
    assert [e["type"] for e in ws.sent] == ["error", "response.output_audio.delta", "session.closed"]
    assert ws.sent[0]["error"]["code"] == "internal_error"
    assert ws.sent[1]["sample_rate_hz"] == 24000
    assert ws.closed_with == 1000


def test_a_session_cancelled_by_the_server_still_ends_with_session_closed() -> None:
    """The gateway's shutdown cancels session tasks: the client still gets ``session.closed``, with reason
    ``server_shutdown`` (not an internal error), before the socket closes."""
    app = create_app(GatewayConfig(stage_addrs={s: "127.0.0.1:1" for s in ("thinker", "talker", "code2wav")}))
    app.state.realtime_pipeline_factory = lambda session: ScriptedPipeline(session, "ok")
    with serve_in_thread(app) as port, connect(f"ws://127.0.0.1:{port}/v1/realtime", open_timeout=10) as ws:
        ws.send(json.dumps({"type": "session.update", "session": session_body()}))
        _until(ws, "session.updated")
        (session,) = app.state.realtime.registry.sessions.values()
        task = session._task
        task.get_loop().call_soon_threadsafe(task.cancel)
        closed, _ = _until(ws, "session.closed")
        assert closed["reason"] == "server_shutdown"
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=5)
