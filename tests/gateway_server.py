"""Run the gateway app under uvicorn in a background thread (for tests against real stage processes)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_in_thread(app: Any, startup_s: float = 30.0) -> Iterator[int]:
    """Serve an ASGI app with uvicorn on a free loopback port in a daemon thread; yields the port."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + startup_s
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started, "uvicorn did not start"
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(30)


class ThreadedGateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.port = free_port()
        app = create_app(config, mount_realtime=False)
        self.app = app
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThreadedGateway:
        self.thread.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{self.url}/v1/models", timeout=1)
                return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("gateway did not start")

    def wait_healthy(self, timeout_s: float) -> None:
        """Wait until ``/health`` is 200 (the gateway's monitor sees every stage serving)."""
        deadline = time.monotonic() + timeout_s
        while httpx.get(f"{self.url}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, httpx.get(f"{self.url}/health", timeout=5).text
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
