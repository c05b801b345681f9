"""Real stage servers and a loopback gateway for the end-to-end realtime tests, plus a recording client.

Every test that needs real thinker/talker/code2wav processes uses these context managers from a
module-scoped fixture, so the stages (10–20 s each to start on a small CPU box) start once per module.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_server import free_port, serve_in_thread

REPO = Path(__file__).resolve().parents[1]
STAGES = ("thinker", "talker", "code2wav")


_BUSY_GAUGE = re.compile(
    r"^(minicpmo_stage_in_flight|minicpmo_stage_streams_active)(?:\{[^}]*\})?\s+(\S+)", re.M
)


@dataclass
class RunningStages:
    addrs: dict[str, str]  # stage -> gRPC host:port
    metrics_urls: dict[str, str]  # stage -> Prometheus endpoint
    # stage -> its server process, for tests that make a stage fail (SIGKILL) under a live session
    processes: dict[str, subprocess.Popen[bytes]]

    def busy(self, stages: Sequence[str] = STAGES) -> dict[str, float]:
        """Per stage (all, or the survivors after a test killed one): open streams plus in-flight work,
        from the stage's own gauges (0 when idle)."""
        out: dict[str, float] = {}
        for stage in stages:
            text = httpx.get(self.metrics_urls[stage], timeout=10).text
            out[stage] = sum(float(m.group(2)) for m in _BUSY_GAUGE.finditer(text))
        return out


@contextmanager
def stage_servers(ckpt: Path, log_dir: Path, thinker_args: Sequence[str] = ()) -> Iterator[RunningStages]:
    """Start the three stage servers on CPU; yields their addresses once all report healthy."""
    from gateway.stage_clients import StageSet

    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    addrs: dict[str, str] = {}
    metrics_urls: dict[str, str] = {}
    try:
        for stage in STAGES:
            port, metrics = free_port(), free_port()
            addrs[stage] = f"127.0.0.1:{port}"
            metrics_urls[stage] = f"http://127.0.0.1:{metrics}/metrics"
            log = (log_dir / f"{stage}.log").open("wb")
            extra = list(thinker_args) if stage == "thinker" else []
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        f"services.{stage}",
                        "--checkpoint",
                        str(ckpt),
                        "--device",
                        "cpu",
                        "--port",
                        str(port),
                        "--metrics-port",
                        str(metrics),
                        *extra,
                    ],
                    cwd=REPO,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )

        async def healthy() -> bool:
            stages = StageSet(addrs)
            try:
                return all(ok for ok, _ in (await stages.health()).values())
            finally:
                await stages.close()

        deadline = time.time() + 600
        while not asyncio.run(healthy()):
            dead = [p for p in procs if p.poll() is not None]
            if dead or time.time() > deadline:
                text = "\n".join((log_dir / f"{s}.log").read_text(errors="replace")[-2000:] for s in STAGES)
                pytest.fail(f"stage servers did not become healthy:\n{text}")
            time.sleep(0.5)
        yield RunningStages(addrs, metrics_urls, dict(zip(STAGES, procs, strict=True)))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


@contextmanager
def realtime_gateway(stage_addrs: dict[str, str], **settings: Any) -> Iterator[str]:
    """The gateway app under uvicorn on loopback; ``settings`` override ``RealtimeSettings`` fields.

    Yields the ``ws://`` base URL.
    """
    from gateway.app import create_app
    from gateway.config import GatewayConfig

    app = create_app(GatewayConfig(stage_addrs=stage_addrs))
    for name, value in settings.items():
        assert hasattr(app.state.realtime_settings, name), name
        setattr(app.state.realtime_settings, name, value)
    with serve_in_thread(app) as port:
        yield f"ws://127.0.0.1:{port}"


class Conn:
    """A synchronous WebSocket client that records every event it receives, in order."""

    def __init__(self, url: str) -> None:
        from websockets.sync.client import connect

        # Entered as a context manager (websockets deprecates a bare connect() call); close() exits it.
        self._connection = connect(url, max_size=None, open_timeout=30)
        self.ws = self._connection.__enter__()
        self.events: list[dict[str, Any]] = []

    def send(self, event: dict[str, Any]) -> None:
        self.ws.send(json.dumps(event))

    def recv(self, timeout: float = 300.0) -> dict[str, Any]:
        event = json.loads(self.ws.recv(timeout=timeout))
        self.events.append(event)
        return event

    def until(self, type_: str, timeout: float = 300.0) -> dict[str, Any]:
        """Receive (and record) events up to the first of ``type_``; returns that event."""
        end = time.time() + timeout
        while True:
            event = self.recv(max(0.1, end - time.time()))
            if event["type"] == type_:
                return event

    def close(self) -> None:
        self._connection.__exit__(None, None, None)


@contextmanager
def closing_session(url: str, seen: list[dict[str, Any]] | None = None) -> Iterator[Conn]:
    """A :class:`Conn` that ends with ``session.close`` (unless the test closed it already), so the session
    frees its admission slot and stage streams at once instead of lingering in the disconnect grace;
    every event it received is added to ``seen`` at the end, if given."""
    conn = Conn(url)
    try:
        yield conn
    finally:
        if not any(e["type"] == "session.closed" for e in conn.events):
            with suppress(Exception):
                conn.send({"type": "session.close"})
                conn.until("session.closed", 30)
        if seen is not None:
            seen.extend(conn.events)
        conn.close()
