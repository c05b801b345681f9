"""Server VAD on the native lane (``turn_detection: {"type": "server_vad"}`` with
``extra_body.auto_response: true``, no overlap policy named): the audio reaches the model unit by unit as
in any native session, silence included, while the detector announces and seals the user's turns and a
speech start over a running response barges in (the overlap policy's default, ``barge_in_on_speech``).

No stage runs: a scripted pipeline records the units it is sent and decides them (listen, or speak on
the first unit when the test asks for a running response).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from gateway_server import serve_in_thread
from realtime_helpers import QuietPipeline, pcm16_b64, session_body, tone
from websockets.sync.client import ClientConnection, connect

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.realtime.pipeline.events import AudioOut, UnitOutcome, UnitRole
from gateway.realtime.session import DuplexSession

VAD = {"type": "server_vad", "detector": "energy"}


class RecordingPipeline(QuietPipeline):
    """Keeps every unit; listens, or speaks (turn left open) on the first unit when ``speak_first``."""

    speak_first = False

    def __init__(self, session: DuplexSession) -> None:
        self.session = session
        self.units: list[np.ndarray] = []
        self.interrupts: list[str] = []

    def push_unit(
        self,
        samples: np.ndarray,
        frames: list[bytes],
        unit_seq: int,
        epoch: int,
        turn_id: int,
        role: UnitRole = UnitRole.PLAIN,
    ) -> None:
        self.units.append(samples.copy())
        if self.speak_first and unit_seq == 0:
            self.session.post_pipeline(UnitOutcome(epoch, unit_seq, "speak", "hello", False, 20, 1))
            self.session.post_pipeline(AudioOut(epoch, np.zeros(24_000, np.float32), False, 1))
        else:
            self.session.post_pipeline(UnitOutcome(epoch, unit_seq, "listen", "", False, 20))

    def interrupt(self, new_epoch: int, reason: str) -> None:
        self.interrupts.append(reason)


@pytest.fixture()
def gateway() -> Iterator[tuple[str, list[RecordingPipeline]]]:
    app = create_app(GatewayConfig(stage_addrs={s: "127.0.0.1:1" for s in ("thinker", "talker", "code2wav")}))
    pipelines: list[RecordingPipeline] = []

    def factory(session: DuplexSession) -> RecordingPipeline:
        pipelines.append(RecordingPipeline(session))
        return pipelines[-1]

    app.state.realtime_pipeline_factory = factory
    with serve_in_thread(app) as port:
        yield f"ws://127.0.0.1:{port}/v1/realtime", pipelines


def _open(ws: ClientConnection) -> dict[str, Any]:
    body = session_body(turn_detection=VAD, extra_body={"auto_response": True})
    del body["overlap_policy"]  # the default follows turn_detection
    ws.send(json.dumps({"type": "session.update", "session": body}))
    created = _next(ws, {"session.created"})
    _next(ws, {"session.updated"})
    return created


def _stream(ws: ClientConnection, x: np.ndarray) -> None:
    for i in range(0, x.size, 3200):
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": pcm16_b64(x[i : i + 3200])}))


def _next(ws: ClientConnection, types: set[str], seen: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    end = time.monotonic() + 10
    while True:
        event = json.loads(ws.recv(timeout=max(0.01, end - time.monotonic())))
        assert event["type"] != "error", event
        if seen is not None:
            seen.append(event)
        if event["type"] in types:
            return event


def test_native_lane_vad_marks_turns_while_the_model_hears_everything(gateway) -> None:  # noqa: ANN001
    url, pipelines = gateway
    silence = np.zeros(int(0.4 * 16000), np.float32)
    with connect(url, open_timeout=10) as ws:
        created = _open(ws)
        assert created["session"]["overlap_policy"] == "barge_in_on_speech"
        seen: list[dict[str, Any]] = []
        _stream(ws, np.concatenate([silence, tone(1.2), silence, silence]))
        started = _next(ws, {"input_audio_buffer.speech_started"}, seen)
        stopped = _next(ws, {"input_audio_buffer.speech_stopped"}, seen)
        assert stopped["item_id"] == started["item_id"]
        committed = _next(ws, {"input_audio_buffer.committed"}, seen)
        assert committed["item_id"] == started["item_id"]
        _next(ws, {"conversation.item.done"}, seen)
        ws.send(json.dumps({"type": "session.close"}))
        _next(ws, {"session.closed"}, seen)
    assert not any(e["type"] == "response.created" for e in seen), "the model owns when to answer"
    units = pipelines[0].units
    # The leading silence went to the model too (no pre-roll gating on the native lane).
    assert len(units) >= 2 and not units[0][:6000].any() and units[0][7000:].any()


def test_native_lane_vad_speech_over_a_response_barges_in(gateway) -> None:  # noqa: ANN001
    url, pipelines = gateway
    RecordingPipeline.speak_first = True
    try:
        with connect(url, open_timeout=10) as ws:
            _open(ws)
            _stream(ws, np.zeros(16000, np.float32))
            rid = _next(ws, {"response.created"})["response_id"]
            _stream(ws, tone(0.6, freq=330.0))  # the user talks over the model's answer
            _next(ws, {"input_audio_buffer.speech_started"})
            decision = _next(ws, {"overlap.decision"})
            assert decision["action"] == "barge_in" and decision["reason"] == "server_vad_speech_started"
            done = _next(ws, {"response.done"})
            assert done["response_id"] == rid
            assert done["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    finally:
        RecordingPipeline.speak_first = False
    assert pipelines[0].interrupts == ["turn_detected"]
