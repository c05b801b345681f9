"""A process that dies in native code says where: every server entry point enables :mod:`faulthandler`.

A segmentation fault inside a C extension (gRPC's core, a codec) kills the process with no Python
traceback at all; the launcher and the benches then only see ``exited with code -11``. With
``faulthandler`` on, the dying process writes every thread's Python stack to stderr (the child's log).
The gateway stands in for the stages here: it starts in a second, and the stages enable it the same way.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from gateway_server import free_port

REPO = Path(__file__).resolve().parents[1]


def test_a_segfault_in_the_gateway_prints_the_python_stacks(tmp_path: Path) -> None:
    port = free_port()
    dead = [f"127.0.0.1:{free_port()}" for _ in range(3)]  # nothing listens: the stages stay "down"
    cmd = [
        sys.executable,
        "-m",
        "gateway",
        "--thinker-addr",
        dead[0],
        "--talker-addr",
        dead[1],
        "--code2wav-addr",
        dead[2],
        "--deploy-config",
        "cpu",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 503:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the gateway did not answer /health in 60 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGSEGV)
        assert proc.wait(timeout=30) == -signal.SIGSEGV
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "Fatal Python error: Segmentation fault" in text, text[-3000:]
    assert "most recent call first" in text  # the stacks follow
