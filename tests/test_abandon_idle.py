"""Abandoned work stops within 1 s on every path a client can walk away from (issue 34).

Real thinker, talker and code2wav processes on the tiny checkpoint behind one gateway (uvicorn on
loopback). Each test starts work, makes sure a stage is busy with it, then drops the client without a
goodbye (the TCP connection shut, no close frame) and measures, from the drop, how long until every
stage's own gauges (``minicpmo_stage_streams_active`` + ``minicpmo_stage_in_flight``) read 0:

* chat stream dropped during prefill (no byte of the response sent yet: the route waits for the first
  event before its 200, and must watch the client meanwhile);
* chat stream dropped mid-stream, after the first text delta;
* non-streaming chat dropped while the thinker generates;
* speech stream dropped after the first audio chunk (talker and code2wav busy);
* realtime socket dropped mid-response (speaking) and mid-input (the model listening to appended
  audio), with the default 30 s resume grace: the session is kept for a resume, its stage streams are
  not. The mid-response case then resumes: the journal replays the response ended ``cancelled`` with
  reason ``client_disconnected``, and a new turn on the resumed session is answered (a fresh thinker
  stream at the session's epoch).

The measured times are printed (``-s``) as ``FIGURE idle_<path>=<s>``; docs/reliability.md quotes them.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gateway_server import serve_in_thread
from realtime_helpers import pcm16_b64, session_body, tone
from realtime_stages import Conn, RunningStages, stage_servers

from gateway.app import create_app
from gateway.config import GatewayConfig
from services.common.deploy_profile import load_profile

pytestmark = pytest.mark.slow

IDLE_BOUND_S = 1.0
MODEL = "openbmb/MiniCPM-o-4_5"
# Long enough that only the drop ends it within the waits below.
LONG_TEXT = {"max_tokens": 400, "sampling_params_list": [{"max_tokens": 400, "ignore_eos": True}]}
LONG_SPEECH = {
    "max_tokens": 400,
    "modalities": ["text", "audio"],
    "sampling_params_list": [{"max_tokens": 400, "ignore_eos": True}, {"max_new_frames": 2000}],
}
PREFILL_WORDS = 3000  # a prompt whose prefill alone keeps the tiny thinker busy for seconds on CPU


@pytest.fixture(scope="module")
def stages(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStages]:
    with stage_servers(tiny_ckpt, tmp_path_factory.mktemp("abandon_logs")) as running:
        yield running


@pytest.fixture(scope="module")
def port(stages: RunningStages) -> Iterator[int]:
    config = GatewayConfig(stage_addrs=stages.addrs, profile=load_profile("cpu"))
    app = create_app(config)
    with serve_in_thread(app) as p:
        yield p


def _busy_total(stages: RunningStages) -> dict[str, float]:
    return stages.busy()


def _wait_busy(stages: RunningStages, stage: str, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while stages.busy([stage])[stage] == 0:
        assert time.monotonic() < end, f"{stage} never got busy"
        time.sleep(0.02)


def _time_to_idle(stages: RunningStages, dropped_at: float, timeout_s: float = 40.0) -> float:
    """Seconds from ``dropped_at`` to the first poll that finds every stage idle (an upper bound)."""
    while True:
        busy = stages.busy()
        now = time.monotonic()
        if not any(busy.values()):
            return now - dropped_at
        assert now - dropped_at < timeout_s, f"stages still busy {now - dropped_at:.1f} s after: {busy}"
        time.sleep(0.02)


def _figure(name: str, value: float) -> None:
    print(f"FIGURE idle_{name}={value:.2f}")


def _raw_request(port: int, body: dict[str, Any]) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    sock.sendall(head + data)
    return sock


def _drop(sock: Any) -> float:
    """The client vanishes: no close frame, no more reads. Returns the monotonic time of the drop."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
    return time.monotonic()


def _read_until(sock: socket.socket, marker: bytes, timeout_s: float = 300.0) -> bytes:
    sock.settimeout(timeout_s)
    seen = b""
    while marker not in seen:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before {marker!r}: {seen[-500:]!r}"
        seen += chunk
    return seen


def _settle(stages: RunningStages) -> None:
    _time_to_idle(stages, time.monotonic(), timeout_s=120.0)


def _chat(content: str, stream: bool, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": stream, **extra}


def test_chat_stream_dropped_during_prefill(stages: RunningStages, port: int) -> None:
    _settle(stages)
    prompt = " ".join(f"w{i % 97}" for i in range(PREFILL_WORDS))
    sock = _raw_request(port, _chat(prompt, True, max_tokens=8))
    _wait_busy(stages, "thinker")
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):  # nothing of the response yet: still in prefill
        sock.recv(1)
    idle = _time_to_idle(stages, _drop(sock))
    _figure("chat_stream_prefill", idle)
    assert idle <= IDLE_BOUND_S


def test_chat_stream_dropped_mid_stream(stages: RunningStages, port: int) -> None:
    _settle(stages)
    sock = _raw_request(port, _chat("hi", True, **LONG_TEXT))
    _read_until(sock, b'"content":"', 300)
    _read_until(sock, b"data:", 60)  # at least one more chunk: generating
    idle = _time_to_idle(stages, _drop(sock))
    _figure("chat_stream_mid", idle)
    assert idle <= IDLE_BOUND_S


def test_non_stream_chat_dropped(stages: RunningStages, port: int) -> None:
    _settle(stages)
    sock = _raw_request(port, _chat("hi", False, **LONG_TEXT))
    _wait_busy(stages, "thinker")
    time.sleep(0.5)  # decoding, not just admitted
    idle = _time_to_idle(stages, _drop(sock))
    _figure("chat_non_stream", idle)
    assert idle <= IDLE_BOUND_S


def test_speech_stream_dropped(stages: RunningStages, port: int) -> None:
    _settle(stages)
    sock = _raw_request(port, _chat("hi", True, **LONG_SPEECH))
    _read_until(sock, b'"modality":"audio"', 300)
    assert stages.busy(["code2wav"])["code2wav"] > 0
    idle = _time_to_idle(stages, _drop(sock))
    _figure("speech_stream", idle)
    assert idle <= IDLE_BOUND_S


def _session(port: int, **extra: Any) -> Conn:
    conn = Conn(f"ws://127.0.0.1:{port}/v1/realtime?duplex=1")
    conn.send({"type": "session.update", "session": session_body(extra_body=extra)})
    conn.until("session.updated", 120)
    return conn


def test_realtime_dropped_mid_response_then_resumed(stages: RunningStages, port: int) -> None:
    _settle(stages)
    conn = _session(port, max_response_units=40)
    created = conn.events[0]
    assert created["type"] == "session.created"
    sid, token = created["session"]["id"], created["resume_token"]
    conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.3))})
    conn.send({"type": "input_audio_buffer.commit"})
    conn.send({"type": "response.create"})
    delta = conn.until("response.output_audio.delta", 300)
    last_seq = delta["server_event_seq"]
    assert stages.busy(["code2wav"])["code2wav"] > 0
    idle = _time_to_idle(stages, _drop(conn.ws.socket))
    _figure("realtime_mid_response", idle)
    assert idle <= IDLE_BOUND_S

    # The session waited for a resume: the journal tells how the response ended, and it goes on.
    again = Conn(f"ws://127.0.0.1:{port}/v1/realtime?duplex=1&resume=1")
    again.send(
        {
            "type": "session.resume",
            "session_id": sid,
            "resume_token": token,
            "last_received_server_event_seq": last_seq,
        }
    )
    assert again.until("session.resumed", 30)["session_id"] == sid
    done = again.until("response.done", 30)
    assert done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"]["reason"] == "client_disconnected"
    again.send({"type": "session.update", "session": {"extra_body": {"max_response_units": 2}}})
    again.until("session.updated", 30)
    again.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.3))})
    again.send({"type": "input_audio_buffer.commit"})
    again.send({"type": "response.create"})
    again.until("response.created", 60)
    finished = again.until("response.done", 300)
    assert finished["response"]["status"] == "completed", finished
    errors = [e for e in again.events if e["type"] == "error"]
    assert not errors, errors
    again.send({"type": "session.close"})
    again.until("session.closed", 30)
    again.close()
    _settle(stages)


def test_realtime_dropped_mid_input(stages: RunningStages, port: int) -> None:
    _settle(stages)
    conn = _session(port, auto_response=True)  # native lane: every appended second goes to the model
    for _ in range(3):
        conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.0))})
    _wait_busy(stages, "thinker")
    idle = _time_to_idle(stages, _drop(conn.ws.socket))
    _figure("realtime_mid_input", idle)
    assert idle <= IDLE_BOUND_S
