"""Realtime WebSocket protocol invariants that never reach a stage (docs/protocol.md, Invariants W*, I*,
B5/B6, S*).

Every test drives the real gateway app (``gateway.app.create_app``) over a real WebSocket through
starlette's TestClient. No stage server runs here: the duplex pipeline opens its thinker stream lazily on
the first unit the model must hear, and none of these tests sends one (turn lane, no response.create).
Tests that need model output live in tests/test_realtime_e2e.py against real stage servers.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from realtime_helpers import (
    EVENT_ID_RE,
    SESSION_ID_RE,
    pcm16_b64,
    receive_until,
    session_body,
    tone,
)

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.realtime.errors import error_type_for


@pytest.fixture()
def app() -> Any:
    app = create_app(
        GatewayConfig(
            stage_addrs={"thinker": "127.0.0.1:1", "talker": "127.0.0.1:1", "code2wav": "127.0.0.1:1"}
        )
    )
    settings = app.state.realtime_settings
    settings.config_timeout_s = 0.5
    settings.disconnect_grace_s = 0.5
    return app


@pytest.fixture()
def client(app: Any) -> Iterator[TestClient]:
    with TestClient(app) as c:
        yield c


def open_session(ws: Any, **overrides: Any) -> dict[str, Any]:
    ws.send_json({"type": "session.update", "session": session_body(**overrides)})
    created = ws.receive_json()
    assert created["type"] == "session.created", created
    updated = ws.receive_json()
    assert updated["type"] == "session.updated"
    return created


def check_error(event: dict[str, Any], code: str, event_id: str | None = None) -> None:
    assert event["type"] == "error", event
    assert event["error"]["code"] == code, event
    assert event["error"]["type"] == error_type_for(code)  # W12
    assert EVENT_ID_RE.match(event["event_id"])
    if event_id is not None:
        assert event["error"].get("event_id") == event_id  # W11


# ------------------------------------------------------------------------------------ handshake (W*)


@pytest.mark.parametrize(
    "path", ["/v1/realtime", "/v1/realtime?duplex=1", "/v1/realtime?duplex=true", "/v1/duplex"]
)
def test_w1_routes_reach_duplex_handler_and_w4_w5_w10_created(client: TestClient, path: str) -> None:
    with client.websocket_connect(path) as ws:
        ws.send_json({"type": "session.update", "session": session_body(id="duplex-" + "0" * 32)})
        created = ws.receive_json()
        assert created["type"] == "session.created"
        assert "server_event_seq" not in created
        sid = created["session"]["id"]
        assert SESSION_ID_RE.match(sid) and sid != "duplex-" + "0" * 32
        assert created["session"]["capabilities"]["supports_session_resume"] is True
        assert created["attachment_generation"] == 1 and isinstance(created["resume_token"], str)
        assert EVENT_ID_RE.match(created["event_id"])
        updated = ws.receive_json()
        assert updated["type"] == "session.updated" and updated["server_event_seq"] == 1
        assert updated["session"]["audio"]["output"]["format"]["rate"] == 24000


def test_non_duplex_realtime_is_flat_unsupported(client: TestClient) -> None:
    with client.websocket_connect("/v1/realtime?duplex=0") as ws:
        event = ws.receive_json()
        assert event == {"type": "error", "error": "Realtime API is not available", "code": "unsupported"}


def test_w2_config_timeout(client: TestClient) -> None:
    with client.websocket_connect("/v1/realtime?duplex=1") as ws:
        check_error(ws.receive_json(), "config_timeout")
        assert ws.receive()["type"] == "websocket.close"


def test_w3_first_frame_faults_then_later_faults_keep_session(client: TestClient) -> None:
    with client.websocket_connect("/v1/duplex") as ws:
        ws.send_text("{not json")
        check_error(ws.receive_json(), "invalid_json")
    with client.websocket_connect("/v1/duplex") as ws:
        ws.send_text("[1, 2]")
        check_error(ws.receive_json(), "bad_event")
    with client.websocket_connect("/v1/duplex") as ws:
        open_session(ws)
        ws.send_text("{not json")
        check_error(ws.receive_json(), "invalid_json")
        ws.send_text("42")
        check_error(ws.receive_json(), "bad_event")
        ws.send_bytes(b"\x00\x01")
        check_error(ws.receive_json(), "bad_event")
        ws.send_json({"type": "session.heartbeat"})
        assert ws.receive_json()["type"] == "session.heartbeat_ack"


def test_w6_ref_audio_required(client: TestClient) -> None:
    with client.websocket_connect("/v1/duplex") as ws:
        body = session_body()
        del body["ref_audio"]
        ws.send_json({"type": "session.update", "event_id": "evt_open", "session": body})
        check_error(ws.receive_json(), "ref_audio_required", "evt_open")
        assert ws.receive()["type"] == "websocket.close"
    with client.websocket_connect("/v1/duplex") as ws:  # text-only sessions need no voice
        body = session_body(modalities=["text"])
        del body["ref_audio"]
        ws.send_json({"type": "session.update", "session": body})
        assert ws.receive_json()["type"] == "session.created"


def test_w7_semantic_vad(client: TestClient) -> None:
    with client.websocket_connect("/v1/duplex") as ws:
        ws.send_json(
            {"type": "session.update", "session": session_body(turn_detection={"type": "semantic_vad"})}
        )
        check_error(ws.receive_json(), "invalid_session_config")
    with client.websocket_connect("/v1/duplex") as ws:
        open_session(ws)
        ws.send_json(
            {
                "type": "session.update",
                "event_id": "e7",
                "session": {"turn_detection": {"type": "semantic_vad"}},
            }
        )
        err = ws.receive_json()
        check_error(err, "unsupported_turn_detection", "e7")
        assert err["error"]["param"] == "turn_detection"


def test_w8_max_sessions(app: Any, client: TestClient) -> None:
    app.state.realtime_settings.max_sessions = 2
    with client.websocket_connect("/v1/duplex") as a, client.websocket_connect("/v1/duplex") as b:
        open_session(a)
        open_session(b)
        with client.websocket_connect("/v1/duplex") as c:
            c.send_json({"type": "session.update", "session": session_body()})
            err = c.receive_json()
            check_error(err, "resource_exhausted")
            assert err["error"]["type"] == "rate_limit_error" and err["error"]["retryable"] is True
        a.send_json({"type": "session.close"})
        receive_until(a, "session.closed")
        deadline = time.time() + 5
        while len(app.state.realtime.registry.sessions) > 1 and time.time() < deadline:
            time.sleep(0.02)
        with client.websocket_connect("/v1/duplex") as d:
            open_session(d)


def _wait_detached(app: Any, session_id: str) -> None:
    """Until the session has seen its socket go (it then waits for a resume)."""
    session = app.state.realtime.registry.sessions[session_id]
    deadline = time.time() + 5
    while session.detached_at is None and time.time() < deadline:
        time.sleep(0.02)
    assert session.detached_at is not None


def test_w8_a_detached_session_gives_its_slot_to_a_new_one(app: Any, client: TestClient) -> None:
    """Every slot taken, one session detached (its client closed the socket, as stock clients do): a new
    session opens at once, the detached one ends and cannot be resumed; an attached one is never taken."""
    settings = app.state.realtime_settings
    settings.max_sessions = 2
    settings.disconnect_grace_s = 30.0  # the grace alone would hold the slot through the whole test
    registry = app.state.realtime.registry
    with client.websocket_connect("/v1/duplex") as a:
        open_session(a)
        with client.websocket_connect("/v1/duplex") as gone:
            created = open_session(gone)
        gone_id = created["session"]["id"]
        _wait_detached(app, gone_id)
        with client.websocket_connect("/v1/duplex") as b:
            open_session(b)  # admitted: the detached session's slot was reclaimed
            assert gone_id not in registry.sessions and len(registry.sessions) == 2
            with client.websocket_connect("/v1/duplex") as c:  # both slots attached: refused as before
                c.send_json({"type": "session.update", "session": session_body()})
                check_error(c.receive_json(), "resource_exhausted")
            with client.websocket_connect("/v1/duplex?autostart=0") as again:
                again.send_json(
                    {
                        "type": "session.resume",
                        "session_id": gone_id,
                        "resume_token": created["resume_token"],
                        "last_received_server_event_seq": 1,
                    }
                )
                check_error(again.receive_json(), "session_resume_expired")
    assert "minicpmo_realtime_sessions_reclaimed_total" in client.get("/metrics").text


async def _resume_then_open(app: Any, sid: str, token: str) -> str:
    """On the app's loop: a resume of detached ``sid`` is posted to its mailbox, then a new session takes
    the one slot before the mailbox runs; returns how the resume ended."""
    from gateway.realtime.attachment import Attachment, hash_token
    from gateway.realtime.config import parse_session
    from gateway.realtime.errors import RealtimeError

    registry = app.state.realtime.registry
    event = {"session_id": sid, "resume_token": token, "last_received_server_event_seq": 1}
    session, last = registry.lookup_for_resume(event)
    done = asyncio.get_running_loop().create_future()
    session.post("attach", (Attachment(session.generation + 1), last, hash_token(token), done))
    voices = app.state.realtime_settings.voice_lookup
    newcomer = registry.open(parse_session(session_body(), voices=voices))  # reclaims sid's slot
    try:
        await asyncio.wait_for(done, 5)
        outcome = "resumed"
    except RealtimeError as exc:
        outcome = exc.code
    await newcomer.end("client_close")
    return outcome


def test_w8_a_resume_already_on_its_way_loses_to_the_reclaim(app: Any, client: TestClient) -> None:
    """The slot of a detached session goes to a new session while a resume of it waits in its mailbox:
    the resume is refused (the session is no longer admitted), it does not bring the session back."""
    settings = app.state.realtime_settings
    settings.max_sessions = 1
    settings.disconnect_grace_s = 30.0
    registry = app.state.realtime.registry
    with client.websocket_connect("/v1/duplex") as gone:
        created = open_session(gone)
    sid = created["session"]["id"]
    _wait_detached(app, sid)
    assert client.portal is not None
    outcome = client.portal.call(_resume_then_open, app, sid, created["resume_token"])
    assert outcome == "session_resume_expired"
    assert sid not in registry.sessions


def test_w9_w10_seq_and_ids(client: TestClient) -> None:
    with client.websocket_connect("/v1/duplex") as ws:
        open_session(ws)
        for _ in range(3):
            ws.send_json({"type": "session.heartbeat"})
        ws.send_json({"type": "nope"})
        events = [ws.receive_json() for _ in range(4)]
        seqs = [e["server_event_seq"] for e in events]
        assert seqs == [2, 3, 4, 5]
        assert all(EVENT_ID_RE.match(e["event_id"]) for e in events)


def test_w11_w13_rejections_echo_event_id(app: Any, client: TestClient) -> None:
    app.state.realtime_settings.max_frame_bytes = 60_000
    with client.websocket_connect("/v1/duplex") as ws:
        open_session(ws)
        ws.send_json({"type": "no.such.event", "event_id": "x1"})
        check_error(ws.receive_json(), "unknown_event", "x1")
        ws.send_json({"type": "input_audio_buffer.append", "event_id": "x2", "audio": "AAA", "format": "aac"})
        check_error(ws.receive_json(), "unsupported_audio_format", "x2")
        ws.send_json({"type": "input_audio_buffer.append", "event_id": "x3", "audio": "!!!notb64"})
        check_error(ws.receive_json(), "bad_audio", "x3")
        ws.send_json({"type": "input_audio_buffer.commit", "event_id": "x4"})
        check_error(ws.receive_json(), "input_audio_buffer_empty", "x4")
        ws.send_json({"type": "response.cancel", "event_id": "x5"})
        check_error(ws.receive_json(), "response_not_active", "x5")
        ws.send_json({"type": "conversation.item.retrieve", "event_id": "x6", "item_id": "item_missing"})
        check_error(ws.receive_json(), "item_not_found", "x6")
        ws.send_json({"type": "session.update", "event_id": "x7", "session": {"model": "other"}})
        check_error(ws.receive_json(), "model_update_unsupported", "x7")
        ws.send_json(
            {
                "type": "input_audio_buffer.append",
                "event_id": "x8",
                "audio": "AAAA",
                "video_frames": ["a", "b", "c"],
            }
        )
        check_error(ws.receive_json(), "invalid_video_frames", "x8")
        ws.send_text(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * 70_000}))
        check_error(ws.receive_json(), "event_too_large")
        ws.send_json({"type": "session.heartbeat"})
        assert ws.receive_json()["type"] == "session.heartbeat_ack"


def test_w14_heartbeat(client: TestClient) -> None:
    with client.websocket_connect("/v1/duplex") as ws:
        created = open_session(ws)
        ws.send_json({"type": "session.heartbeat"})
        ack = ws.receive_json()
        assert ack["type"] == "session.heartbeat_ack" and ack["session_id"] == created["session"]["id"]


# ------------------------------------------------------------------------------------ input (I*)


def test_i1_audio_validation(client: TestClient) -> None:
    with client.websocket_connect("/v1/duplex") as ws:
        open_session(ws)
        ws.send_json(
            {"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x00\x01\x02").decode()}
        )
        check_error(ws.receive_json(), "bad_audio")
        for rate in (7999, 192001, 16000.5, "16000"):
            ws.send_json(
                {"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(0.1)), "sample_rate_hz": rate}
            )
            check_error(ws.receive_json(), "bad_event")
        ws.send_json({"type": "input_audio_buffer.append", "audio": "QUJD*"})
        check_error(ws.receive_json(), "bad_audio")


def _jpeg() -> str:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (255, 0, 0)).save(buf, format="JPEG")
    return base64.b64encode(buf.getvalue()).decode()


def test_i2_video_frames(client: TestClient) -> None:
    frame = _jpeg()
    png_like_text = base64.b64encode(b"GIF89a....").decode()
    cases = [
        {"video_frames": [frame, frame, frame]},
        {"video_frames": [png_like_text]},
        {"video_frames": ["data:image/jpeg;base64," + frame]},
        {"video_frames": ["A" * 4_000_004]},
        {"video_frames": [frame], "max_slice_nums": 2},
    ]
    with client.websocket_connect("/v1/duplex") as ws:
        open_session(ws)
        for case in cases:
            ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(0.2)), **case})
            check_error(ws.receive_json(), "invalid_video_frames")
        ws.send_json({"type": "input_audio_buffer.append", "audio": "", "video_frames": [frame]})
        check_error(ws.receive_json(), "invalid_input_modality")
        ws.send_json(
            {
                "type": "input_audio_buffer.append",
                "audio": pcm16_b64(tone(0.2)),
                "video_frames": [frame, frame],
            }
        )
        ws.send_json({"type": "session.heartbeat"})
        assert ws.receive_json()["type"] == "session.heartbeat_ack"  # two valid frames are accepted silently


def test_i3_i4_i5_commit(client: TestClient) -> None:
    with client.websocket_connect("/v1/duplex") as ws:
        open_session(ws)
        ws.send_json({"type": "input_audio_buffer.commit"})
        check_error(ws.receive_json(), "input_audio_buffer_empty")
        # I4: speech appends of arbitrary sizes (0.3 s + 0.45 s), then commit
        ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(0.3))})
        ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(0.45))})
        ws.send_json({"type": "input_audio_buffer.commit"})
        events = [ws.receive_json() for _ in range(4)]
        assert [e["type"] for e in events] == [
            "conversation.item.added",
            "conversation.item.created",
            "input_audio_buffer.committed",
            "conversation.item.done",
        ]
        item_id = events[0]["item"]["id"]
        assert events[2]["item_id"] == item_id and events[2]["event"]["turn_id"] == 1
        assert events[3]["item"]["id"] == item_id
        # I5: non-speech commit -> listen, no response
        ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(0.2)), "is_speech": False})
        ws.send_json({"type": "input_audio_buffer.commit", "is_speech": False, "response_create": True})
        events = receive_until(ws, "response.listen")
        assert events[-1]["response"]["metadata"]["reason"] == "silence_or_noise"
        assert not any(e["type"] == "response.created" for e in events)
        # retrieve the committed user item
        ws.send_json({"type": "conversation.item.retrieve", "item_id": item_id})
        got = ws.receive_json()
        assert got["type"] == "conversation.item.retrieved" and got["item"]["role"] == "user"
        ws.send_json({"type": "conversation.item.delete", "item_id": item_id})
        assert ws.receive_json()["type"] == "conversation.item.deleted"
        ws.send_json({"type": "conversation.item.retrieve", "item_id": item_id})
        check_error(ws.receive_json(), "item_not_found")


def test_turn_lane_silent_units_listen(client: TestClient) -> None:
    with client.websocket_connect("/v1/duplex") as ws:
        open_session(ws)
        silence = np.zeros(16000 * 2 + 800, dtype=np.float32)
        for i in range(0, silence.size, 3200):
            ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16_b64(silence[i : i + 3200])})
        listens = [ws.receive_json() for _ in range(2)]  # exactly two whole units closed
        assert [e["response"]["metadata"]["reason"] for e in listens] == ["silence_or_noise"] * 2
        ws.send_json({"type": "session.heartbeat"})
        assert ws.receive_json()["type"] == "session.heartbeat_ack"


def test_i6_i7_unsupported_inputs(client: TestClient) -> None:
    with client.websocket_connect("/v1/duplex") as ws:
        open_session(ws)
        ws.send_json({"type": "input.text.append", "text": "hi"})
        check_error(ws.receive_json(), "native_text_append_unsupported")
        ws.send_json({"type": "response.create", "response": {"voice": "alloy"}})
        refused = ws.receive_json()
        check_error(refused, "unsupported_native_response_options")
        assert refused["error"]["param"] == "response.voice"
        for bad, param in (
            ({"max_output_tokens": 0}, "response.max_output_tokens"),
            ({"max_output_tokens": "many"}, "response.max_output_tokens"),
            ({"output_modalities": ["video"]}, "response.output_modalities"),
            ({"instructions": 5}, "response.instructions"),
            ({"nonsense": 1}, "response.nonsense"),
        ):
            ws.send_json({"type": "response.create", "response": bad})
            refused = ws.receive_json()
            assert refused["type"] == "error" and refused["error"]["param"] == param, (bad, refused)
            assert refused["error"]["type"] == "invalid_request_error"
        # Valid options pass validation; the missing input is what is refused then.
        ws.send_json({"type": "response.create", "response": {"instructions": "x", "max_output_tokens": 5}})
        check_error(ws.receive_json(), "response_create_without_input")


def test_input_formats_accepted(client: TestClient) -> None:
    """pcm16 at other declared rates, pcm_f32le and G.711 all decode into 1 s units (two each)."""
    from gateway.realtime.audio import g711_encode

    x24 = tone(2.0, rate=24000)
    x8 = tone(2.0, rate=8000)
    appends = [
        {"audio": pcm16_b64(x24), "sample_rate_hz": 24000},
        {
            "audio": base64.b64encode(x24.astype("<f4").tobytes()).decode(),
            "format": "pcm_f32le",
            "sample_rate_hz": 24000,
        },
        {
            "audio": base64.b64encode(g711_encode((x8 * 32767).astype(np.int16), "ulaw")).decode(),
            "format": "g711_ulaw",
        },
        {
            "audio": base64.b64encode(g711_encode((x8 * 32767).astype(np.int16), "alaw")).decode(),
            "format": "g711_alaw",
        },
    ]
    with client.websocket_connect("/v1/duplex") as ws:
        open_session(ws)
        for extra in appends:
            ws.send_json({"type": "input_audio_buffer.append", **extra})
            ws.send_json({"type": "input_audio_buffer.commit"})
            events = receive_until(ws, "conversation.item.done")
            committed = [e for e in events if e["type"] == "input_audio_buffer.committed"]
            assert committed and committed[0]["event"]["message"] == "speech"
        session = app_session(ws, client)
        assert sum(len(item.units) for item in session.committed_backlog) == 8


@pytest.mark.parametrize(
    ("extra", "rate"),
    [
        ({"type": "realtime"}, 24000),  # GA session object, no rate: GA's 24 kHz
        ({"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}}}, 24000),
        ({"type": "realtime", "sample_rate_hz": 16000}, 16000),  # a declared rate wins
        ({}, 16000),  # the dialect's own default (DuplexClient, the browser page)
    ],
)
def test_ga_session_shapes(client: TestClient, extra: dict[str, Any], rate: int) -> None:
    """GA shapes where the dialect leaves room: MIME format types, GA's 24 kHz default for GA session objects,
    ``audio.input.turn_detection`` echoed; the appended audio is decoded at that rate (2 s = two units)."""
    with client.websocket_connect("/v1/duplex") as ws:
        body = {k: v for k, v in session_body().items() if k not in ("sample_rate_hz", "input_audio_format")}
        ws.send_json({"type": "session.update", "session": {**body, **extra}})
        created = ws.receive_json()
        assert created["type"] == "session.created", created
        audio = created["session"]["audio"]
        assert audio["input"]["format"] == {"type": "audio/pcm", "rate": rate}
        assert audio["output"]["format"] == {"type": "audio/pcm", "rate": 24000}
        assert (
            audio["input"]["turn_detection"] is None and created["session"]["input_audio_format"] == "pcm16"
        )
        ws.receive_json()
        ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(2.0, rate=rate))})
        ws.send_json({"type": "input_audio_buffer.commit"})
        receive_until(ws, "conversation.item.done")
        assert sum(len(item.units) for item in app_session(ws, client).committed_backlog) == 2


def app_session(ws: Any, client: TestClient) -> Any:
    sessions = list(client.app.state.realtime.registry.sessions.values())
    assert len(sessions) == 1
    return sessions[0]


# ------------------------------------------------------------------------------------ interrupts without a response


def test_b5_cancel_and_clear_without_response(client: TestClient) -> None:
    with client.websocket_connect("/v1/duplex") as ws:
        open_session(ws)
        ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(0.5))})
        ws.send_json({"type": "input.cancel"})
        assert ws.receive_json()["type"] == "input_audio_buffer.cleared"
        ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(0.5))})
        ws.send_json({"type": "input_audio_buffer.clear"})
        assert ws.receive_json()["type"] == "input_audio_buffer.cleared"
        ws.send_json({"type": "input_audio_buffer.commit"})
        check_error(ws.receive_json(), "input_audio_buffer_empty")
        ws.send_json({"type": "output_audio_buffer.clear"})
        assert ws.receive_json()["type"] == "output_audio_buffer.cleared"
        assert app_session(ws, client).epoch == 1  # input.cancel advanced the epoch, clears did not


def test_b6_barge_in_gated_by_capability(app: Any, client: TestClient) -> None:
    app.state.realtime_settings.supports_barge_in = False
    with client.websocket_connect("/v1/duplex") as ws:
        created = open_session(ws)
        assert created["session"]["capabilities"]["supports_barge_in"] is False
        ws.send_json({"type": "barge_in", "event_id": "b6"})
        check_error(ws.receive_json(), "barge_in_unsupported", "b6")


def test_b7_playback_ack_without_audio(client: TestClient) -> None:
    with client.websocket_connect("/v1/duplex") as ws:
        open_session(ws)
        ws.send_json({"type": "playback.ack", "played_ms": 100})
        check_error(ws.receive_json(), "playback_item_not_found")
        ws.send_json({"type": "playback.ack"})
        check_error(ws.receive_json(), "bad_event")


# ------------------------------------------------------------------------------------ session end, resume, limits (S*)


def test_s1_close(client: TestClient) -> None:
    with client.websocket_connect("/v1/duplex") as ws:
        created = open_session(ws)
        ws.send_json({"type": "session.close"})
        closed = ws.receive_json()
        assert closed["type"] == "session.closed" and closed["reason"] == "client_close"
        assert closed["session_id"] == created["session"]["id"]
        msg = ws.receive()
        assert msg["type"] == "websocket.close" and msg["code"] == 1000


def test_s2_s4_resume_replays_and_replaces(client: TestClient) -> None:
    with client.websocket_connect("/v1/duplex") as first:
        created = open_session(first)
        sid, token = created["session"]["id"], created["resume_token"]
        for _ in range(3):
            first.send_json({"type": "session.heartbeat"})
        acks = [first.receive_json() for _ in range(3)]  # seq 2, 3, 4
        with client.websocket_connect("/v1/duplex?autostart=0") as second:
            second.send_json(
                {
                    "type": "session.resume",
                    "session_id": sid,
                    "resume_token": token,
                    "last_received_server_event_seq": 2,
                }
            )
            resumed = second.receive_json()
            assert resumed["type"] == "session.resumed" and "server_event_seq" not in resumed
            assert resumed["attachment_generation"] == 2 and resumed["resume_token"] != token
            replay = [second.receive_json() for _ in range(2)]
            assert [(e["server_event_seq"], e["event_id"]) for e in replay] == [
                (a["server_event_seq"], a["event_id"]) for a in acks[1:]
            ]
            replaced = first.receive_json()
            assert replaced["type"] == "session.replaced" and replaced["attachment_generation"] == 2
            assert first.receive()["type"] == "websocket.close"
            second.send_json({"type": "session.heartbeat"})
            assert second.receive_json()["server_event_seq"] == 5  # the sequence continues
            new_token = resumed["resume_token"]
            with client.websocket_connect("/v1/duplex?autostart=0") as third:
                third.send_json(
                    {
                        "type": "session.resume",
                        "session_id": sid,
                        "resume_token": token,
                        "last_received_server_event_seq": 0,
                    }
                )
                check_error(third.receive_json(), "invalid_resume_token")
            assert new_token


def test_s3_journal_gap(client: TestClient) -> None:
    with client.websocket_connect("/v1/duplex") as first:
        created = open_session(first)
        sid, token = created["session"]["id"], created["resume_token"]
        first.send_json({"type": "session.heartbeat"})
        first.receive_json()
        first.send_json({"type": "session.event_ack", "server_event_seq": 2})
        first.send_json({"type": "session.event_ack", "server_event_seq": 99})
        check_error(first.receive_json(), "invalid_event_ack")  # S7
    with client.websocket_connect("/v1/duplex?resume=1") as second:
        second.send_json(
            {
                "type": "session.resume",
                "session_id": sid,
                "resume_token": token,
                "last_received_server_event_seq": 0,
            }
        )
        assert second.receive_json()["type"] == "session.resumed"
        resync = second.receive_json()
        assert resync["type"] == "session.resync_required" and resync["reason"] == "journal_gap"


def test_s5_grace_expiry(client: TestClient) -> None:
    with client.websocket_connect("/v1/duplex") as first:
        created = open_session(first)
    time.sleep(1.2)
    with client.websocket_connect("/v1/duplex?autostart=0") as second:
        second.send_json(
            {
                "type": "session.resume",
                "session_id": created["session"]["id"],
                "resume_token": created["resume_token"],
                "last_received_server_event_seq": 1,
            }
        )
        check_error(second.receive_json(), "session_resume_expired")


def test_s6_resume_mid_session(client: TestClient) -> None:
    with client.websocket_connect("/v1/duplex") as ws:
        open_session(ws)
        ws.send_json({"type": "session.resume", "session_id": "x", "resume_token": "y"})
        check_error(ws.receive_json(), "unsupported_session_resume")
        ws.send_json({"type": "session.heartbeat"})
        assert ws.receive_json()["type"] == "session.heartbeat_ack"


def test_s9_input_backpressure(client: TestClient) -> None:
    with client.websocket_connect("/v1/duplex") as ws:
        open_session(ws)
        for _ in range(4):
            ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(0.2))})
            ws.send_json({"type": "input_audio_buffer.commit"})
            receive_until(ws, "conversation.item.done")
        ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(0.2))})
        ws.send_json({"type": "input_audio_buffer.commit", "event_id": "s9"})
        err = ws.receive_json()
        check_error(err, "input_backpressure", "s9")
        assert err["error"]["type"] == "rate_limit_error"


def test_i8_declared_rates_give_equivalent_units(client: TestClient) -> None:
    """The same speech declared at 16 kHz and at 24 kHz reaches the model as the same 16 kHz units."""
    with client.websocket_connect("/v1/duplex") as ws:
        open_session(ws)
        for rate in (16000, 24000):
            ws.send_json(
                {
                    "type": "input_audio_buffer.append",
                    "audio": pcm16_b64(tone(2.0, rate=rate)),
                    "sample_rate_hz": rate,
                }
            )
            ws.send_json({"type": "input_audio_buffer.commit"})
            receive_until(ws, "conversation.item.done")
        first, second = app_session(ws, client).committed_backlog
        assert len(first.units) == len(second.units) == 2
        a = np.concatenate([u.samples for u in first.units])
        b = np.concatenate([u.samples for u in second.units])
        inner = slice(160, -160)  # resampler edge transients
        assert np.max(np.abs(a[inner] - b[inner])) < 0.01


def test_api_key_guards_the_socket() -> None:
    app = create_app(
        GatewayConfig(
            stage_addrs={"thinker": "127.0.0.1:1", "talker": "127.0.0.1:1", "code2wav": "127.0.0.1:1"},
            api_key="sekret",
        )
    )
    with TestClient(app) as client:
        with client.websocket_connect("/v1/duplex") as ws:
            check_error(ws.receive_json(), "invalid_api_key")
        with client.websocket_connect("/v1/duplex", headers={"Authorization": "Bearer sekret"}) as ws:
            open_session(ws)
        metrics_text = client.get("/metrics").text
        assert "minicpmo_realtime_sessions" in metrics_text


def test_idle_timeout_detaches_and_session_is_resumable(client: TestClient) -> None:
    with client.websocket_connect("/v1/duplex") as ws:
        created = open_session(ws, idle_timeout_s=0.3)
        assert ws.receive()["type"] == "websocket.close"  # no frame for 0.3 s: treated as a disconnect
    with client.websocket_connect("/v1/duplex?autostart=0") as ws:
        ws.send_json(
            {
                "type": "session.resume",
                "session_id": created["session"]["id"],
                "resume_token": created["resume_token"],
                "last_received_server_event_seq": 1,
            }
        )
        assert ws.receive_json()["type"] == "session.resumed"


def test_w5_no_resume_token_without_the_capability(app: Any, client: TestClient) -> None:
    app.state.realtime_settings.supports_session_resume = False
    with client.websocket_connect("/v1/duplex") as ws:
        created = open_session(ws)
        assert created["session"]["capabilities"]["supports_session_resume"] is False
        assert "resume_token" not in created and "attachment_generation" not in created
    with client.websocket_connect("/v1/duplex?autostart=0") as ws:
        ws.send_json({"type": "session.resume", "session_id": created["session"]["id"], "resume_token": "x"})
        check_error(ws.receive_json(), "unsupported_session_resume")


def test_s9_pending_input_bytes(app: Any, client: TestClient) -> None:
    app.state.realtime_settings.max_pending_input_bytes = 200_000  # ~3 s of buffered 16 kHz float audio
    with client.websocket_connect("/v1/duplex") as ws:
        open_session(ws)
        for _ in range(3):
            ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.0))})
        ws.send_json({"type": "input_audio_buffer.append", "event_id": "big", "audio": pcm16_b64(tone(1.0))})
        err = ws.receive_json()
        check_error(err, "input_backpressure", "big")
        ws.send_json({"type": "input_audio_buffer.clear"})
        assert ws.receive_json()["type"] == "input_audio_buffer.cleared"
        ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.0))})
        ws.send_json({"type": "session.heartbeat"})
        assert ws.receive_json()["type"] == "session.heartbeat_ack"  # accepted again after the clear


@pytest.mark.parametrize(
    "bad",
    [
        {"idle_timeout_s": "soon"},
        {"temperature": "hot"},
        {"extra_body": {"force_listen_count": "x"}},
        {"max_response_output_tokens": [1]},
        {"sample_rate_hz": "fast"},
    ],
)
def test_malformed_session_fields_are_typed_errors(client: TestClient, bad: dict[str, Any]) -> None:
    with client.websocket_connect("/v1/duplex") as ws:
        open_session(ws)
        ws.send_json({"type": "session.update", "event_id": "u1", "session": bad})
        err = ws.receive_json()
        assert err["type"] == "error" and err["error"]["code"] in ("invalid_session_config", "bad_event")
        assert err["error"]["event_id"] == "u1"
        ws.send_json({"type": "session.heartbeat"})
        assert ws.receive_json()["type"] == "session.heartbeat_ack"
    with client.websocket_connect("/v1/duplex") as ws:  # the same faults on the opening update
        ws.send_json({"type": "session.update", "session": session_body(**bad)})
        err = ws.receive_json()
        assert err["type"] == "error" and err["error"]["code"] in ("invalid_session_config", "bad_event")


def test_wrongly_typed_fields_never_derail_the_session(client: TestClient) -> None:
    """Every command with every field of the wrong type: a typed client error, never internal_error."""
    from gateway.realtime.commands import HANDLERS

    junk = {
        "audio": 5,
        "delta": [],
        "session": 7,
        "item": 3,
        "item_id": 4,
        "played_ms": "x",
        "committed_ms": {},
        "event": 9,
        "payload": 1,
        "server_event_seq": "x",
        "response": 2,
        "video_frames": 5,
        "audio_end_ms": "x",
        "response_id": 3,
        "response_create": "yes",
        "sample_rate_hz": "fast",
        "format": 1,
    }
    skip = {"session.close", "close", "close_session"}
    with client.websocket_connect("/v1/duplex") as ws:
        open_session(ws)
        for kind in sorted(set(HANDLERS) - skip):
            ws.send_json({"type": kind, "event_id": f"j_{kind}", **junk})
            ws.send_json({"type": "session.heartbeat"})
            events = receive_until(ws, "session.heartbeat_ack")
            codes = [e["error"]["code"] for e in events if e["type"] == "error"]
            assert "internal_error" not in codes, (kind, codes)


def test_tool_definitions_are_validated_by_field_and_the_session_goes_on(client: TestClient) -> None:
    """Session and per-response ``tools`` / ``tool_choice``: a bad definition names its exact field
    (``invalid_request_error``) and the session goes on; valid tools are taken and echoed in GA's shape; a
    ``function_call_output`` must answer a call of this conversation (``param: item.call_id``), and a
    client cannot add the model's own ``function_call`` items."""
    fn = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    with client.websocket_connect("/v1/duplex") as ws:
        open_session(ws)
        cases = [
            ({"tools": [{"type": "function", "description": "x"}]}, "session.tools[0].name", "invalid_value"),
            ({"tools": [fn, {**fn}]}, "session.tools[1].name", "invalid_value"),
            ({"tools": [{**fn, "parameters": {"type": 5}}]}, "session.tools[0].parameters", "invalid_value"),
            ({"tools": "get_weather"}, "session.tools", "invalid_value"),
            ({"tools": [{"type": "web_search", "name": "x"}]}, "session.tools[0].type", "invalid_value"),
            ({"tools": [{"type": "function", "name": "a b"}]}, "session.tools[0].name", "invalid_value"),
            (
                {"tools": [fn], "tool_choice": {"type": "function", "name": "nope"}},
                "session.tool_choice",
                None,
            ),
            ({"tool_choice": "required"}, "session.tool_choice", "invalid_value"),
        ]
        for i, (session, param, code) in enumerate(cases):
            ws.send_json({"type": "session.update", "event_id": f"t{i}", "session": session})
            err = ws.receive_json()
            assert err["type"] == "error" and err["error"]["param"] == param, (session, err)
            assert err["error"]["type"] == "invalid_request_error"
            if code is not None:
                assert err["error"]["code"] == code
        ws.send_json({"type": "session.update", "session": {"tools": [fn], "tool_choice": "required"}})
        updated = ws.receive_json()
        assert updated["type"] == "session.updated", updated
        assert updated["session"]["tools"] == [fn] and updated["session"]["tool_choice"] == "required"
        # A later update of the tools alone keeps the choice, checked against the new tools.
        ws.send_json({"type": "session.update", "session": {"tools": []}})
        err = ws.receive_json()
        assert err["type"] == "error" and err["error"]["param"] == "session.tool_choice", err
        named = {"type": "function", "name": "get_weather"}
        ws.send_json({"type": "session.update", "session": {"tool_choice": named}})
        assert ws.receive_json()["session"]["tool_choice"] == named
        ws.send_json({"type": "session.update", "session": {"tools": [], "tool_choice": "auto"}})
        assert ws.receive_json()["type"] == "session.updated"
        ws.send_json({"type": "response.create", "response": {"tools": [{"type": "function"}]}})
        err = ws.receive_json()
        assert err["type"] == "error" and err["error"]["param"] == "response.tools[0].name"
        ws.send_json({"type": "response.create", "response": {"tool_choice": "required"}})
        err = ws.receive_json()
        assert err["type"] == "error" and err["error"]["param"] == "response.tool_choice"
        for item, param in [
            ({"type": "function_call_output"}, "item.call_id"),
            ({"type": "function_call_output", "call_id": "call_x", "output": "{}"}, "item.call_id"),
            ({"type": "function_call_output", "call_id": "call_x", "output": 5}, "item.output"),
            ({"type": "function_call", "call_id": "call_x", "name": "f", "arguments": "{}"}, "item.type"),
        ]:
            ws.send_json({"type": "conversation.item.create", "item": item})
            err = ws.receive_json()
            assert err["type"] == "error" and err["error"]["param"] == param, (item, err)
            assert err["error"]["type"] == "invalid_request_error"
        ws.send_json({"type": "session.heartbeat"})
        assert ws.receive_json()["type"] == "session.heartbeat_ack"
