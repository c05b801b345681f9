"""The embedded launcher (``python -m gateway.launcher``) under faults, with its real child processes.

1. A stage SIGKILLed after start-up is restarted by the launcher itself (the tree keeps running); the
   gateway's ``/health`` names it within 2 s, requests that need it are 503 + ``Retry-After`` meanwhile,
   and succeed again within 10 s of the restarted stage's first SERVING - no gateway restart.
2. SIGTERM to the launcher with a streaming chat in flight and a realtime session open: the chat
   finishes normally (the stages stop only after the gateway), the realtime client gets
   ``session.closed{reason:"server_shutdown"}``, the launcher exits 0 and no child process is left.

Measured times are printed (``-s``) as ``FIGURE name=value`` for docs/reliability.md.
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

import httpx
import pytest
from gateway_server import free_port
from realtime_helpers import session_body
from realtime_stages import Conn
from stage_processes import StageProcess

pytestmark = pytest.mark.slow

MODEL = "openbmb/MiniCPM-o-4_5"
OVERRIDES = {"thinker": {"sampling": {"max_tokens": 8}}, "talker": {"sampling": {"max_new_frames": 25}}}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) is not running
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.05) -> float:  # noqa: ANN001
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"{what} not within {timeout_s} s"
        time.sleep(poll_s)
    return time.monotonic() - start


def _chat(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def test_launcher_restarts_a_dead_stage_and_stops_in_order(tiny_ckpt: Path, tmp_path: Path) -> None:
    port = free_port()
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
        "--stage-overrides",
        json.dumps(OVERRIDES),
    ]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    with out_path.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
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
        starts = re.findall(r"start (\S+) on \S+ port (\d+) pid (\d+)", text)
        pids = {name: int(pid) for name, _, pid in starts}
        ports = {name: int(p) for name, p, _ in starts}

        # ---- 1. SIGKILL code2wav: the launcher restarts it, the gateway recovers by itself
        os.kill(pids["code2wav-0"], signal.SIGKILL)
        health_s = _wait_for(
            lambda: httpx.get(f"{url}/health", timeout=5).json()["stages"]["code2wav"] != "ok",
            2.0,
            "/health naming code2wav",
        )
        print(f"FIGURE launcher_kill_health_s={health_s:.2f}")
        r = httpx.post(f"{url}/v1/chat/completions", json=_chat(stream=True), timeout=60)
        if r.status_code == 503:  # unless the restart already won the race
            assert int(r.headers["retry-after"]) >= 1 and "code2wav" in r.json()["error"]["message"]
        c2w = StageProcess("code2wav", ports["code2wav-0"], 0, proc, out_path)  # only for .serving()
        _wait_for(lambda: "restarted code2wav-0" in out_path.read_text(), 30, "launcher restart")
        _wait_for(c2w.serving, 300, "restarted code2wav SERVING")
        serving_at = time.monotonic()
        pids["code2wav-0"] = int(
            re.findall(r"restarted code2wav-0 on port \d+ pid (\d+)", out_path.read_text())[-1]
        )
        while True:
            sent_at = time.monotonic()
            assert sent_at - serving_at < 10, "no recovery within 10 s of SERVING"
            r = httpx.post(f"{url}/v1/chat/completions", json=_chat(), timeout=120)
            if r.status_code == 200:
                break
            assert r.status_code == 503, r.text
            time.sleep(0.1)
        print(f"FIGURE launcher_recovery_after_serving_s={sent_at - serving_at:.2f}")
        assert proc.poll() is None and all(_alive(pid) for pid in pids.values())

        # ---- 2. SIGTERM with work in flight
        conn = Conn(f"ws://127.0.0.1:{port}/v1/realtime?duplex=1")
        conn.send({"type": "session.update", "session": session_body()})
        conn.until("session.updated", 60)
        chat_lines: list[str] = []
        first_delta = threading.Event()

        def stream_chat() -> None:
            body = _chat(
                stream=True,
                modalities=["text"],
                max_tokens=60,
                sampling_params_list=[{"max_tokens": 60, "ignore_eos": True}],
            )
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as resp:
                for line in resp.iter_lines():
                    if line:
                        chat_lines.append(line)
                        if '"content":"' in line and '"content":""' not in line:
                            first_delta.set()

        chat = threading.Thread(target=stream_chat)
        chat.start()
        assert first_delta.wait(120), chat_lines
        sigterm_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        closed = conn.until("session.closed", 30)
        assert closed["reason"] == "server_shutdown", closed
        print(f"FIGURE launcher_sigterm_session_closed_s={time.monotonic() - sigterm_at:.2f}")
        chat.join(60)
        assert chat_lines[-1] == "data: [DONE]", chat_lines[-3:]
        last = json.loads(chat_lines[-2].removeprefix("data: "))
        assert "error" not in last and last["choices"][0]["finish_reason"] == "length", last
        assert proc.wait(90) == 0, out_path.read_text()[-3000:]
        print(f"FIGURE launcher_sigterm_exit_s={time.monotonic() - sigterm_at:.2f}")
        left = [name for name, pid in pids.items() if _alive(pid)]
        assert not left, f"processes left after the launcher exited: {left}"
        conn.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for pid in pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
