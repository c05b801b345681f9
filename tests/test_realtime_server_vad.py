"""Server VAD over the real realtime WebSocket, without stages: configuration validation on open and on
update (docs/protocol.md, Realtime session object; W7) and the input-side events that need no model output.

The full turn (speech stop → commit → spoken response → barge-in by speech) runs against real stage
servers in tests/test_realtime_e2e.py::test_server_vad_turns_and_barge_in.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from realtime_helpers import pcm16_b64, session_body, tone

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.realtime.errors import error_type_for
from gateway.realtime.vad import DEFAULTS

# The tests here drive the detector with synthetic tones, which only the energy fallback calls speech; the
# Silero default is tested on synthesized speech in tests/test_realtime_silero_vad.py.
VAD = {"type": "server_vad", "detector": "energy"}
ITEM_ID_RE = re.compile(r"^item_[0-9a-f]{24}$")


@pytest.fixture()
def client() -> Iterator[TestClient]:
    app = create_app(
        GatewayConfig(
            stage_addrs={"thinker": "127.0.0.1:1", "talker": "127.0.0.1:1", "code2wav": "127.0.0.1:1"}
        )
    )
    with TestClient(app) as c:
        yield c


def open_vad(ws: Any, **td: Any) -> dict[str, Any]:
    ws.send_json(
        {
            "type": "session.update",
            "session": session_body(turn_detection={**VAD, **td}, overlap_policy="barge_in_on_speech"),
        }
    )
    created = ws.receive_json()
    assert created["type"] == "session.created", created
    assert ws.receive_json()["type"] == "session.updated"
    return created


def expect_error(ws: Any, code: str, event_id: str | None = None) -> dict[str, Any]:
    event = ws.receive_json()
    assert event["type"] == "error", event
    assert event["error"]["code"] == code, event
    assert event["error"]["type"] == error_type_for(code)
    assert event["error"].get("param") == "turn_detection", event
    if event_id is not None:
        assert event["error"]["event_id"] == event_id
    return event


def append(ws: Any, x: np.ndarray, chunk_s: float = 0.2) -> None:
    step = int(chunk_s * 16_000)
    for i in range(0, x.size, step):
        ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16_b64(x[i : i + step])})


def next_after_heartbeat(ws: Any) -> list[dict[str, Any]]:
    """Every event the server sent before answering a heartbeat (the session loop is strictly ordered)."""
    ws.send_json({"type": "session.heartbeat"})
    seen = []
    while (event := ws.receive_json())["type"] != "session.heartbeat_ack":
        seen.append(event)
    return seen


def test_open_with_server_vad_echoes_normalised_config(client: TestClient) -> None:
    with client.websocket_connect("/v1/duplex") as ws:
        created = open_vad(ws, silence_duration_ms=700, create_response=False)
        session = created["session"]
        assert session["turn_detection"] == {
            **DEFAULTS,
            **VAD,
            "silence_duration_ms": 700,
            "create_response": False,
        }
        assert session["overlap_policy"] == "barge_in_on_speech"
        assert session["capabilities"]["supports_server_vad"] is True


@pytest.mark.parametrize(
    ("turn_detection", "overlap", "extra"),
    [
        ({"type": "server_vad"}, "listen_only", {}),
        ({"type": "semantic_vad"}, "barge_in_on_speech", {}),
        ({"type": "server_vad", "interrupt_response": False}, "barge_in_on_speech", {}),
        ({"type": "server_vad", "idle_timeout_ms": 5000}, "barge_in_on_speech", {}),
        ({"type": "server_vad", "threshold": 0}, "barge_in_on_speech", {}),
        ({"type": "server_vad", "silence_duration_ms": -5}, "barge_in_on_speech", {}),
        ("server_vad", "barge_in_on_speech", {}),
        (None, "barge_in_on_speech", {}),
    ],
)
def test_open_rejections_are_invalid_session_config(
    client: TestClient, turn_detection: Any, overlap: str, extra: dict[str, Any]
) -> None:
    with client.websocket_connect("/v1/duplex") as ws:
        body = session_body(turn_detection=turn_detection, overlap_policy=overlap, **extra)
        ws.send_json({"type": "session.update", "event_id": "open1", "session": body})
        expect_error(ws, "invalid_session_config", "open1")
        assert ws.receive()["type"] == "websocket.close"


def test_updates_switch_modes_and_reject_with_the_specific_code(client: TestClient) -> None:
    with client.websocket_connect("/v1/duplex") as ws:
        ws.send_json({"type": "session.update", "session": session_body()})
        assert ws.receive_json()["type"] == "session.created"
        assert ws.receive_json()["type"] == "session.updated"
        rejected = [
            {"turn_detection": VAD, "overlap_policy": "listen_only"},  # an explicit pair that does not fit
            {"overlap_policy": "barge_in_on_speech"},  # still null
            {"turn_detection": {"type": "semantic_vad"}, "overlap_policy": "barge_in_on_speech"},
            {"turn_detection": {**VAD, "interrupt_response": False}, "overlap_policy": "barge_in_on_speech"},
        ]
        for i, update in enumerate(rejected):
            ws.send_json({"type": "session.update", "event_id": f"u{i}", "session": update})
            expect_error(ws, "unsupported_turn_detection", f"u{i}")
        # turn_detection alone: the overlap policy follows it (server VAD barges in, null listens).
        ws.send_json({"type": "session.update", "session": {"turn_detection": {**VAD, "threshold": 0.7}}})
        updated = ws.receive_json()
        assert updated["type"] == "session.updated"
        assert updated["session"]["turn_detection"] == {**DEFAULTS, **VAD, "threshold": 0.7}
        assert updated["session"]["overlap_policy"] == "barge_in_on_speech"
        ws.send_json(
            {"type": "session.update", "event_id": "u9", "session": {"overlap_policy": "listen_only"}}
        )
        expect_error(ws, "unsupported_turn_detection", "u9")  # server VAD needs barge-in
        ws.send_json({"type": "session.update", "session": {"turn_detection": None}})
        back = ws.receive_json()
        assert back["type"] == "session.updated" and back["session"]["turn_detection"] is None
        assert back["session"]["overlap_policy"] == "listen_only"
        ws.send_json({"type": "session.update", "session": {"turn_detection": {"type": "server_vad"}}})
        vad = ws.receive_json()
        assert vad["type"] == "session.updated" and vad["session"]["turn_detection"]["type"] == "server_vad"
        assert vad["session"]["overlap_policy"] == "barge_in_on_speech"


def test_server_vad_alone_is_accepted_on_the_native_lane(client: TestClient) -> None:
    """The native lane takes ``turn_detection: {"type": "server_vad"}`` without an overlap policy (it
    defaults to ``barge_in_on_speech``); the audio still reaches the model unit by unit while the
    detector announces and seals the user's turns."""
    with client.websocket_connect("/v1/duplex") as ws:
        body = session_body(turn_detection=VAD, extra_body={"auto_response": True})
        del body["overlap_policy"]
        ws.send_json({"type": "session.update", "session": body})
        created = ws.receive_json()
        assert created["type"] == "session.created", created
        assert created["session"]["overlap_policy"] == "barge_in_on_speech"
        assert created["session"]["turn_detection"] == {**DEFAULTS, **VAD}
        assert ws.receive_json()["type"] == "session.updated"


def test_silence_never_enters_the_buffer(client: TestClient) -> None:
    with client.websocket_connect("/v1/duplex") as ws:
        open_vad(ws)
        append(ws, np.zeros(32_000, dtype=np.float32))
        assert next_after_heartbeat(ws) == []  # no speech events, no silence listens
        ws.send_json({"type": "input_audio_buffer.commit", "event_id": "c1"})
        event = ws.receive_json()
        assert event["type"] == "error" and event["error"]["code"] == "input_audio_buffer_empty"


def test_speech_started_then_client_clear_and_commit(client: TestClient) -> None:
    """speech_started carries the padded start on the session's audio clock and the future item's id; a
    clear forgets the speech (no speech_stopped), a manual commit seals the announced item."""
    with client.websocket_connect("/v1/duplex") as ws:
        open_vad(ws)
        append(ws, np.concatenate([np.zeros(16_000, dtype=np.float32), tone(0.6)]))
        events = next_after_heartbeat(ws)
        assert [e["type"] for e in events] == ["input_audio_buffer.speech_started"]
        assert events[0]["audio_start_ms"] == 700 and ITEM_ID_RE.match(events[0]["item_id"])
        ws.send_json({"type": "input_audio_buffer.clear"})
        assert ws.receive_json()["type"] == "input_audio_buffer.cleared"
        append(ws, np.zeros(16_000, dtype=np.float32))
        assert next_after_heartbeat(ws) == []  # the cleared speech never "stops"

        append(ws, tone(0.6))
        started = next_after_heartbeat(ws)
        assert [e["type"] for e in started] == ["input_audio_buffer.speech_started"]
        assert started[0]["audio_start_ms"] == 2_600 - 300  # the session clock kept running across the clear
        ws.send_json({"type": "input_audio_buffer.commit"})
        seen = next_after_heartbeat(ws)
        committed = next(e for e in seen if e["type"] == "input_audio_buffer.committed")
        assert committed["item_id"] == started[0]["item_id"]
        assert committed["event"]["message"] == "speech"
        assert "response.created" not in [e["type"] for e in seen]  # a manual commit alone is not answered
        append(ws, np.zeros(16_000, dtype=np.float32))
        assert next_after_heartbeat(ws) == []  # the committed speech does not stop a second time


def test_detected_turn_over_the_commit_backlog_is_refused_and_dropped(client: TestClient) -> None:
    """A speech stop while the pending-commit backlog is full: ``input_backpressure``, the turn's audio is
    dropped (nothing committed, nothing answered) and the session goes on."""
    client.app.state.realtime_settings.max_pending_commits = 0
    with client.websocket_connect("/v1/duplex") as ws:
        open_vad(ws, silence_duration_ms=400)
        silence = np.zeros(int(0.4 * 16_000), dtype=np.float32)
        append(ws, np.concatenate([silence, tone(1.0), silence, silence]))
        seen = next_after_heartbeat(ws)
        types = [e["type"] for e in seen]
        assert types[:2] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped"], types
        errors = [e for e in seen if e["type"] == "error"]
        assert [e["error"]["code"] for e in errors] == ["input_backpressure"]
        assert errors[0]["error"]["type"] == error_type_for("input_backpressure")
        assert not {"input_audio_buffer.committed", "conversation.item.done", "response.created"} & set(types)
        # The dropped audio is gone: a manual commit now has nothing to commit.
        ws.send_json({"type": "input_audio_buffer.commit", "event_id": "evt_commit"})
        event = ws.receive_json()
        assert event["type"] == "error" and event["error"]["event_id"] == "evt_commit", event
        assert event["error"]["code"] == "input_audio_buffer_empty", event
