"""``minicpmo-serve`` (the embedded launcher: three real stage processes + the gateway) on the tiny
checkpoint, started as a user would and stopped with SIGTERM, for tests that drive it as a client."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from gateway_server import free_port

STARTUP_TIMEOUT_S = 900
# Short replies keep the CPU time down: thinker 12 tokens, talker 50 frames (2 s of speech).
SHORT_REPLIES = {"thinker": {"sampling": {"max_tokens": 12}}, "talker": {"sampling": {"max_new_frames": 50}}}


@dataclass
class Served:
    url: str  # http://127.0.0.1:PORT (the gateway; /v1/... and /v1/realtime)
    stage_ports: dict[str, int]
    proc: subprocess.Popen[str]
    log_dir: Path


@contextmanager
def launched(ckpt: Path, log_dir: Path, overrides: dict[str, Any] | None = None) -> Iterator[Served]:
    """Start the launcher, wait for its ready line, yield, then SIGTERM it (kill after 60 s)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "gateway.launcher",
        "--checkpoint",
        str(ckpt),
        "--deploy-config",
        "cpu",
        "--device",
        "cpu",
        "--stage-ports",
        "auto",
        "--port",
        str(port),
        "--log-dir",
        str(log_dir),
        "--stage-overrides",
        json.dumps(SHORT_REPLIES if overrides is None else overrides),
        "--startup-timeout",
        str(STARTUP_TIMEOUT_S),
    ]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    out_path = log_dir / "launcher.out"
    out = open(out_path, "w")  # noqa: SIM115 - the child writes to it until teardown
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    stage_ports: dict[str, int] = {}
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S + 60
        while True:
            text = out_path.read_text()
            if "[minicpmo-serve] ready" in text:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"minicpmo-serve did not start:\n{text}")
            time.sleep(1)
        for stage, p in re.findall(r"start (thinker|talker|code2wav)-0 on cpu port (\d+)", text):
            stage_ports[stage] = int(p)
        yield Served(f"http://127.0.0.1:{port}", stage_ports, proc, log_dir)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        out.close()
