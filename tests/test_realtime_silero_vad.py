"""Server VAD on the real Silero model (gateway/realtime/vad.py, ``detector: "silero"``, the default):
espeak-ng speech under white noise at 0 dB SNR is found with its start and stop within 100 ms, the same
noise alone starts no turn, append sizes do not matter, and a session with the default detector turns the
noisy speech into one detected, committed user item over the real WebSocket."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from realtime_helpers import pcm16_b64, session_body
from speech_fixtures import RATE, active_rms, espeak, feed, speech_span, white_noise
from starlette.websockets import WebSocketDisconnect

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.realtime import vad
from gateway.realtime.vad import SileroVad, SpeechStarted, SpeechStopped, normalize_server_vad

TOLERANCE = RATE // 10  # 100 ms
LEAD, TAIL = int(1.2 * RATE), int(1.5 * RATE)


def params(**overrides: Any) -> dict[str, Any]:
    return normalize_server_vad({"type": "server_vad", **overrides})


@pytest.fixture(scope="module")
def clean() -> np.ndarray:
    speech = espeak()
    return np.concatenate([np.zeros(LEAD, np.float32), speech, np.zeros(TAIL, np.float32)])


def noisy(clean: np.ndarray, seed: int) -> np.ndarray:
    return clean + white_noise(clean.size, active_rms(clean), seed)  # noise as loud as the speech: 0 dB


def run(audio: np.ndarray, chunk: int | None = None, **overrides: Any) -> list[Any]:
    return feed(SileroVad(params(**overrides)), audio, chunk)


def test_default_detector_is_silero_and_speech_is_voiced(clean: np.ndarray) -> None:
    assert params()["detector"] == "silero"
    assert vad.silero_available()
    detector = SileroVad(params())
    window = vad.SILERO_WINDOW
    start, end = speech_span(clean)
    probs = [detector.score(clean[i : i + window]) for i in range(0, clean.size - window + 1, window)]
    voiced = [p for i, p in enumerate(probs) if start <= i * window < end]
    assert np.mean(np.array(voiced) >= 0.5) > 0.8  # most of the sentence scores as speech
    assert max(probs[: LEAD // window - 2]) < 0.1  # digital silence before it does not


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speech_at_0db_snr_has_the_right_start_and_stop(clean: np.ndarray, seed: int) -> None:
    start, end = speech_span(clean)
    events = run(noisy(clean, seed))
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped], events
    began, stopped = events
    assert abs(began.speech_sample - start) <= TOLERANCE, (began.speech_sample, start)
    assert began.start_sample == began.speech_sample - 300 * RATE // 1000  # the default prefix padding
    speech_end = stopped.end_sample - 500 * RATE // 1000  # the stop closes a 500 ms silence window
    assert abs(speech_end - end) <= TOLERANCE + vad.SILERO_WINDOW, (speech_end, end)


@pytest.mark.parametrize("seed", [3, 4])
def test_noise_alone_at_the_same_level_starts_no_turn(clean: np.ndarray, seed: int) -> None:
    level = active_rms(clean)
    assert run(white_noise(6 * RATE, level, seed)) == []
    # The energy fallback, by contrast, calls that noise speech: the reason Silero is the default.
    energy = vad.EnergyVad(params(detector="energy"))
    assert [type(e) for e in energy.process(white_noise(6 * RATE, level, seed))] == [SpeechStarted]


@pytest.mark.parametrize("chunk", [160, 3_200, 7_777])
def test_append_sizes_do_not_change_the_outcome(clean: np.ndarray, chunk: int) -> None:
    audio = noisy(clean, 0)
    assert run(audio, chunk=chunk) == run(audio)


def test_threshold_is_a_probability(clean: np.ndarray) -> None:
    audio = noisy(clean, 0)
    strict = run(audio, threshold=0.999)
    assert len(strict) < 2 or strict[0].speech_sample > run(audio)[0].speech_sample  # needs clearer speech
    assert [type(e) for e in run(audio, threshold=0.1)][:1] == [SpeechStarted]


# ------------------------------------------------------------------ through a session


@pytest.fixture()
def client() -> Iterator[TestClient]:
    app = create_app(
        GatewayConfig(
            stage_addrs={"thinker": "127.0.0.1:1", "talker": "127.0.0.1:1", "code2wav": "127.0.0.1:1"}
        )
    )
    with TestClient(app) as c:
        yield c


def _open_vad(ws: Any, **td: Any) -> None:
    body = session_body(turn_detection={"type": "server_vad", **td}, overlap_policy="barge_in_on_speech")
    ws.send_json({"type": "session.update", "session": body})


def _events_until_closed(ws: Any) -> list[dict[str, Any]]:
    """Everything the server sends until it closes the socket (here: when the missing thinker fails)."""
    seen: list[dict[str, Any]] = []
    try:
        while True:
            seen.append(ws.receive_json())
    except WebSocketDisconnect:
        return seen


def test_session_with_the_default_detector_detects_noisy_speech(
    client: TestClient, clean: np.ndarray
) -> None:
    """The stop commits the user item; answering it fails for lack of stages (none run here, so the session
    ends), which is beside the point: the item was detected, sized and committed from the noisy audio."""
    start, end = speech_span(clean)
    audio = noisy(clean, 5)
    with client.websocket_connect("/v1/duplex") as ws:
        _open_vad(ws)
        created = ws.receive_json()
        assert created["session"]["turn_detection"]["detector"] == "silero"
        assert ws.receive_json()["type"] == "session.updated"
        step = RATE // 5
        for i in range(0, audio.size, step):
            ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16_b64(audio[i : i + step])})
        seen = _events_until_closed(ws)
    by_type = {e["type"]: e for e in seen}
    began = by_type["input_audio_buffer.speech_started"]
    stopped = by_type["input_audio_buffer.speech_stopped"]
    assert abs(began["audio_start_ms"] + 300 - start * 1000 // RATE) <= 100
    assert abs(stopped["audio_end_ms"] - 500 - end * 1000 // RATE) <= 100 + 32
    assert by_type["input_audio_buffer.committed"]["item_id"] == began["item_id"] == stopped["item_id"]


def test_missing_model_is_refused_with_a_reason(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    import gateway.realtime.config as config

    monkeypatch.setattr(config, "silero_available", lambda: False)
    with client.websocket_connect("/v1/duplex") as ws:
        _open_vad(ws)
        event = ws.receive_json()
        assert event["type"] == "error" and event["error"]["code"] == "server_vad_unavailable", event
        assert "energy" in event["error"]["message"]
    with client.websocket_connect("/v1/duplex") as ws:
        _open_vad(ws, detector="energy")
        assert ws.receive_json()["type"] == "session.created"
