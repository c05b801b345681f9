"""SIGTERM to the launcher drains instead of cutting (issue 34): real launcher, stages and gateway.

With ``--drain-grace 4`` and, in flight at the signal, three streaming chats that cannot finish in 4 s,
one realtime session speaking a long response and one realtime session idle:

* the idle session gets ``session.closed{server_shutdown}`` at once;
* while draining, a new chat request is a 503 with ``Retry-After`` and a new realtime session is refused
  (``resource_exhausted``, retryable), and ``/health`` says ``shutting_down``;
* when the grace is over every chat stream gets a final SSE ``error`` event and then ``[DONE]`` (never a
  bare cut) and the speaking session gets ``session.closed{server_shutdown}``;
* then the stages stop, the launcher exits 0 and no child process is left.

(A chat that can finish within the grace finishes normally: tests/test_launcher_faults.py.)
The outcome of each stream and the times are printed (``-s``) as ``FIGURE`` lines.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_server import free_port
from realtime_helpers import pcm16_b64, session_body, tone
from realtime_stages import Conn
from test_launcher_faults import _alive, _wait_for

pytestmark = pytest.mark.slow

MODEL = "openbmb/MiniCPM-o-4_5"
GRACE_S = 4.0
STREAMS = 3
LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "modalities": ["text"],
    "max_tokens": 2000,
    "sampling_params_list": [{"max_tokens": 2000, "ignore_eos": True}],
}


class _Stream(threading.Thread):
    """One streaming chat, recording its SSE data lines and when it ended."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.lines: list[str] = []
        self.generating = threading.Event()
        self.ended_at: float | None = None
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=LONG, timeout=120) as resp:
                for line in resp.iter_lines():
                    if line:
                        self.lines.append(line)
                        if '"content":"' in line and '"content":""' not in line:
                            self.generating.set()
        except BaseException as exc:  # noqa: BLE001 - a bare cut shows here
            self.failure = exc
        finally:
            self.ended_at = time.monotonic()


def _launch(tiny_ckpt: Path, tmp_path: Path, port: int) -> tuple[subprocess.Popen[str], Path]:
    out_path = tmp_path / "launcher.out"
    cmd = [
        sys.executable,
        "-m",
        "gateway.launcher",
        "--checkpoint",
        str(tiny_ckpt),
        "--deploy-config",
        "cpu",
        "--device",
        "cpu",
        "--stage-ports",
        "auto",
        "--port",
        str(port),
        "--log-dir",
        str(tmp_path / "logs"),
        "--drain-grace",
        str(GRACE_S),
    ]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    with out_path.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    return proc, out_path


def _speaking(port: int) -> Conn:
    conn = Conn(f"ws://127.0.0.1:{port}/v1/realtime?duplex=1")
    conn.send({"type": "session.update", "session": session_body(extra_body={"max_response_units": 40})})
    conn.until("session.updated", 60)
    conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.3))})
    conn.send({"type": "input_audio_buffer.commit"})
    conn.send({"type": "response.create"})
    conn.until("response.output_audio.delta", 300)
    return conn


def test_sigterm_drains_then_ends_what_is_left_with_a_final_event(tiny_ckpt: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc, out_path = _launch(tiny_ckpt, tmp_path, port)
    pids: dict[str, int] = {}
    try:
        _wait_for(
            lambda: "[minicpmo-serve] ready" in out_path.read_text() or proc.poll() is not None,
            900,
            "launcher ready",
            1.0,
        )
        text = out_path.read_text()
        assert proc.poll() is None, text
        pids = {
            name: int(pid) for name, _, pid in re.findall(r"start (\S+) on \S+ port (\d+) pid (\d+)", text)
        }
        for line in text.splitlines():  # the launcher logs JSON, one object per line
            assert json.loads(line)["logger"] == "minicpmo.launcher", line

        idle = Conn(f"ws://127.0.0.1:{port}/v1/realtime?duplex=1")
        idle.send({"type": "session.update", "session": session_body()})
        idle.until("session.updated", 60)
        speaking = _speaking(port)
        streams = [_Stream(url) for _ in range(STREAMS)]
        for s in streams:
            s.start()
        for s in streams:
            assert s.generating.wait(300), s.lines
        sigterm_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)

        closed = idle.until("session.closed", 10)
        assert closed["reason"] == "server_shutdown"
        idle_closed_s = time.monotonic() - sigterm_at
        # Draining: nothing new is admitted.
        r = httpx.post(f"{url}/v1/chat/completions", json={**LONG, "stream": False}, timeout=10)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
        assert httpx.get(f"{url}/health", timeout=5).json()["status"] == "shutting_down"
        refused = Conn(f"ws://127.0.0.1:{port}/v1/realtime?duplex=1")
        refused.send({"type": "session.update", "session": session_body()})
        error = refused.until("error", 10)["error"]
        assert error["code"] == "resource_exhausted" and error["retryable"] is True, error
        refused.close()

        closed = speaking.until("session.closed", GRACE_S + 10)
        assert closed["reason"] == "server_shutdown"
        speaking_closed_s = time.monotonic() - sigterm_at
        assert not [e for e in speaking.events if e["type"] == "error"]
        outcomes: list[dict[str, Any]] = []
        for s in streams:
            s.join(GRACE_S + 20)
            assert s.failure is None, f"stream cut bare: {s.failure!r} after {s.lines[-2:]}"
            assert s.lines[-1] == "data: [DONE]", s.lines[-3:]
            last = json.loads(s.lines[-2].removeprefix("data: "))
            assert "error" in last, last
            assert "shutting down" in last["error"]["message"] and last["error"]["code"] == "server_shutdown"
            assert s.ended_at is not None
            ended_s = s.ended_at - sigterm_at
            assert GRACE_S - 0.5 <= ended_s <= GRACE_S + 5, ended_s
            outcomes.append({"ended_s": round(ended_s, 2), "final": "error+[DONE]"})
        assert GRACE_S - 0.5 <= speaking_closed_s <= GRACE_S + 5, speaking_closed_s

        assert proc.wait(60) == 0, out_path.read_text()[-3000:]
        exit_s = time.monotonic() - sigterm_at
        left = [name for name, pid in pids.items() if _alive(pid)]
        assert not left, f"processes left after the launcher exited: {left}"
        print(f"FIGURE drain_idle_session_closed_s={idle_closed_s:.2f}")
        print(f"FIGURE drain_speaking_session_closed_s={speaking_closed_s:.2f}")
        print(f"FIGURE drain_streams={json.dumps(outcomes)}")
        print(f"FIGURE drain_launcher_exit_s={exit_s:.2f} rc=0 left=0")
        idle.close()
        speaking.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for pid in pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
