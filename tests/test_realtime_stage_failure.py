"""A stage process dies under a live realtime session (docs/protocol.md, Realtime session end; Realtime
errors; docs/realtime.md).

Real thinker, talker and code2wav servers on the tiny checkpoint behind the gateway (uvicorn on
loopback). A response is got going through the turn lane (append, commit, ``response.create``) and a
stage process is then SIGKILLed while that response is speaking:

* thinker: the session's model state is gone, so the session ends: ``error{code:"stage_unavailable"}``,
  the response ``failed``, ``session.closed{reason:"stage_unavailable"}`` as the last event, socket close
  1000, and no stream left open on the surviving talker and code2wav (their own gauges read 0);
* talker: only the response's voice is lost: ``error``, the response ``failed``, the speaking turn's
  code2wav stream closed; the session stays open and ``session.close`` still ends it cleanly;
* code2wav: the same, seen from the other side: the speaking turn's talker stream is closed, and the
  session keeps its thinker state, so it stays open.

Every test starts its own stages (it kills one of them), which costs a stage start-up per test.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from realtime_helpers import pcm16_b64, session_body, tone
from realtime_invariants import check_response_invariants
from realtime_stages import Conn, RunningStages, realtime_gateway, stage_servers
from websockets.exceptions import ConnectionClosedOK

pytestmark = pytest.mark.slow

LONG = {"max_response_units": 40}  # still speaking when the stage is killed


@pytest.fixture()
def stages(tiny_ckpt: Path, tmp_path: Path) -> Iterator[RunningStages]:
    with stage_servers(tiny_ckpt, tmp_path) as running:
        yield running


@pytest.fixture()
def conn(stages: RunningStages) -> Iterator[Conn]:
    with realtime_gateway(stages.addrs, seed=0) as url:
        c = Conn(f"{url}/v1/realtime?duplex=1")
        try:
            yield c
        finally:
            c.close()


def _speaking_response(conn: Conn, stages: RunningStages) -> str:
    """Open a session and get a turn-lane response speaking (talker and code2wav streams open)."""
    conn.send({"type": "session.update", "session": session_body(extra_body=LONG)})
    conn.until("session.updated", 60)
    conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.3))})
    conn.send({"type": "input_audio_buffer.commit"})
    conn.until("conversation.item.done", 60)
    conn.send({"type": "response.create"})
    rid = conn.until("response.output_audio.delta")["response_id"]
    busy = stages.busy(("talker", "code2wav"))
    assert busy["talker"] > 0 and busy["code2wav"] > 0, busy  # the speaking turn's streams are open
    return rid


def _kill(stages: RunningStages, stage: str) -> None:
    proc = stages.processes[stage]
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)


def _wait_idle(stages: RunningStages, survivors: tuple[str, ...], timeout: float = 10.0) -> dict[str, float]:
    end = time.time() + timeout
    while any((busy := stages.busy(survivors)).values()) and time.time() < end:
        time.sleep(0.2)
    return busy


def _failed(conn: Conn, rid: str, code: str) -> dict[str, Any]:
    error = conn.until("error", 60)
    assert error["error"]["code"] == code, error
    assert error["error"]["type"] == "server_error" and error["error"]["retryable"] is False
    done = conn.until("response.done", 30)
    assert done["response_id"] == rid
    assert done["response"]["status"] == "failed"
    assert done["response"]["status_details"] == {
        "type": "failed",
        "reason": code,
        "error": {"type": "server_error", "code": code},
    }
    return error


def test_thinker_killed_mid_response_ends_the_session(conn: Conn, stages: RunningStages) -> None:
    rid = _speaking_response(conn, stages)
    _kill(stages, "thinker")
    _failed(conn, rid, "stage_unavailable")
    closed = conn.until("session.closed", 30)
    assert closed["reason"] == "stage_unavailable"
    assert closed["event"] == {"type": "session.closed", "reason": "stage_unavailable"}
    with pytest.raises(ConnectionClosedOK) as info:
        conn.recv(30)  # nothing follows session.closed but the close frame
    assert info.value.rcvd is not None and info.value.rcvd.code == 1000
    busy = _wait_idle(stages, ("talker", "code2wav"))
    assert not any(busy.values()), busy
    check_response_invariants(conn.events)


@pytest.mark.parametrize(("killed", "survivor"), [("talker", "code2wav"), ("code2wav", "talker")])
def test_a_voice_stage_killed_mid_response_fails_only_the_response(
    conn: Conn, stages: RunningStages, killed: str, survivor: str
) -> None:
    rid = _speaking_response(conn, stages)
    _kill(stages, killed)
    _failed(conn, rid, "stage_unavailable")
    busy = _wait_idle(stages, (survivor,))
    assert not any(busy.values()), busy  # the failed turn's stream on the surviving stage was closed
    conn.send({"type": "session.heartbeat"})
    conn.until("session.heartbeat_ack", 60)  # the session is still open
    assert not [e for e in conn.events if e["type"] == "session.closed"]
    conn.send({"type": "session.close"})
    assert conn.until("session.closed", 30)["reason"] == "client_close"
    summary = check_response_invariants(conn.events)
    assert summary[rid]["status"] == "failed"
    done_at = next(
        n for n, e in enumerate(conn.events) if e["type"] == "response.done" and e["response_id"] == rid
    )
    assert not any(e.get("response_id") == rid for e in conn.events[done_at + 1 :])
