"""The browser client's server: static page, config, and the same-origin WebSocket proxy to a real gateway.

The gateway runs under uvicorn on loopback (no stage is contacted: the session only opens, heartbeats and
closes). The page's JavaScript runs in headless Chromium against the real pipeline in
tests/test_realtime_web_browser.py.
"""

from __future__ import annotations

import wave
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from gateway_server import serve_in_thread
from realtime_helpers import session_body

from examples.online_serving.minicpmo.realtime_web.__main__ import create_app as create_web_app


@pytest.fixture()
def gateway_ws() -> Iterator[str]:
    from gateway.app import create_app
    from gateway.config import GatewayConfig

    app = create_app(GatewayConfig(stage_addrs={s: "127.0.0.1:1" for s in ("thinker", "talker", "code2wav")}))
    with serve_in_thread(app) as port:
        yield f"ws://127.0.0.1:{port}/v1/realtime"


def test_page_config_and_proxy(gateway_ws: str, tmp_path: Path) -> None:
    ref = tmp_path / "ref.wav"
    with wave.open(str(ref), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((np.sin(np.arange(16000) / 9) * 9000).astype("<i2").tobytes())
    web = create_web_app(gateway_ws, ref)
    with TestClient(web) as client:
        page = client.get("/")
        assert page.status_code == 200 and "app.js" in page.text
        script = client.get("/app.js").text
        assert "getUserMedia" in script and "input_audio_buffer.append" in script
        worklet = client.get("/capture-worklet.js")
        assert worklet.status_code == 200 and worklet.headers["content-type"].startswith("text/javascript")
        assert 'registerProcessor("capture"' in worklet.text and '"capture-worklet.js"' in script
        config = client.get("/config.json").json()
        assert config["ref_audio"].startswith("data:audio/wav;base64,") and config["realtime_url"] is None
        with client.websocket_connect("/v1/realtime?duplex=1&autostart=0") as ws:
            ws.send_json({"type": "session.update", "session": session_body(ref_audio=config["ref_audio"])})
            created = ws.receive_json()
            assert created["type"] == "session.created" and created["session"]["id"].startswith("duplex-")
            assert ws.receive_json()["type"] == "session.updated"
            ws.send_json({"type": "session.heartbeat"})
            assert ws.receive_json()["type"] == "session.heartbeat_ack"
            ws.send_json({"type": "session.close"})
            assert ws.receive_json()["type"] == "session.closed"
