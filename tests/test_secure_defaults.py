"""Secure defaults and structured logs (issue 34).

* The API key comes from ``MINICPMO_API_KEY`` or ``--api-key-file`` (``--api-key`` still works); the
  launcher hands it to the gateway child in its environment, never on its command line.
* Every entry point binds loopback unless ``--host`` says otherwise; the gateway (and the launcher)
  refuse a non-loopback address without a key unless ``--allow-insecure``.
* Logs are one JSON object per line; every line logged for a request carries its request id (the one
  the client sent as ``X-Request-Id``, else a fresh one, echoed in the response), realtime lines carry
  the session id, client text cannot break a line, and neither the key nor request content is logged.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import APIRouter
from fastapi.testclient import TestClient
from realtime_helpers import session_body

from gateway import logs
from gateway.app import build_parser, config_from_args, create_app
from gateway.auth import API_KEY_ENV, ApiKeyError, is_loopback, resolve_api_key
from gateway.config import GatewayConfig
from gateway.launcher import build_parser as launcher_parser
from gateway.launcher import gateway_options

REPO = Path(__file__).resolve().parents[1]
DEAD = {s: "127.0.0.1:1" for s in ("thinker", "talker", "code2wav")}


def test_key_from_file_env_or_flag(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert resolve_api_key(None, str(key_file), {API_KEY_ENV: "from-env"}) == "from-file"
    assert resolve_api_key("from-flag", None, {API_KEY_ENV: "from-env"}) == "from-flag"
    assert resolve_api_key(None, None, {API_KEY_ENV: "from-env"}) == "from-env"
    assert resolve_api_key(None, None, {API_KEY_ENV: ""}) is None
    assert resolve_api_key(None, None, {}) is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ApiKeyError, match="empty"):
        resolve_api_key(None, str(tmp_path / "empty"), {})
    with pytest.raises(ApiKeyError, match="cannot read"):
        resolve_api_key(None, str(tmp_path / "missing"), {})


def test_gateway_reads_the_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "env-key")
    config = config_from_args(build_parser().parse_args([]))
    assert config.api_key == "env-key"
    with TestClient(create_app(config)) as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer env-key"}).status_code == 200
        assert client.get("/health").status_code in (200, 503)  # public


def test_launcher_passes_the_key_in_the_environment_only(tmp_path: Path) -> None:
    args = launcher_parser().parse_args(["--served-model-name", "m"])
    flags, env = gateway_options(args, 30.0, "sekret-key")
    assert "sekret-key" not in " ".join(flags) and "--api-key" not in flags
    assert env == {API_KEY_ENV: "sekret-key"} and "--drain-grace" in flags
    _, env = gateway_options(args, 30.0, None)
    assert env == {API_KEY_ENV: ""}  # no key: the launcher's own environment is not inherited


def test_every_entry_point_binds_loopback_by_default() -> None:
    from services.code2wav.__main__ import build_parser as code2wav_parser
    from services.talker.server import build_parser as talker_parser
    from services.thinker.__main__ import build_parser as thinker_parser

    assert build_parser().parse_args([]).host == "127.0.0.1"
    assert launcher_parser().parse_args([]).host == "127.0.0.1"
    for parser in (thinker_parser(), talker_parser(), code2wav_parser()):
        args, _ = parser.parse_known_args(["--checkpoint", "/ckpt"])
        assert args.host == "127.0.0.1"


def test_is_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.1.2.3")


@pytest.mark.parametrize("entry", ["gateway", "gateway.launcher"])
def test_non_loopback_bind_without_a_key_is_refused(entry: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    cmd = [sys.executable, "-m", entry, "--host", "0.0.0.0", "--port", "1"]
    if entry == "gateway.launcher":
        cmd += ["--checkpoint", "/nonexistent", "--device", "cpu"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "without an API key" in proc.stderr and "--allow-insecure" in proc.stderr, proc.stderr


@pytest.fixture()
def captured() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    logs.configure("info", process="gateway", stream=stream)
    try:
        yield stream
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])


def _lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_request_lines_are_json_with_the_request_id(captured: io.StringIO) -> None:
    router = APIRouter()
    log = logging.getLogger("gateway.test_route")

    @router.post("/v1/boom")
    async def boom(payload: dict[str, str]) -> None:
        log.info("handling a request for %s", payload["who"])  # client text, newline included
        raise RuntimeError("boom")

    config = GatewayConfig(stage_addrs=DEAD, api_key="the-secret-key")
    app = create_app(config, extra_routers=[router], mount_realtime=False)
    auth = {"Authorization": "Bearer the-secret-key"}
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/boom", json={"who": 'a\nb"c'}, headers={**auth, "X-Request-Id": "rid-42"})
        assert r.status_code == 500 and r.headers["x-request-id"] == "rid-42"
        fresh = client.post("/v1/boom", json={"who": "x"}, headers=auth)
        generated = fresh.headers["x-request-id"]
        assert generated.startswith("req-")
        bad = client.post("/v1/boom", json={"who": "x"}, headers={**auth, "X-Request-Id": "a b\x7f" * 30})
        assert bad.headers["x-request-id"].startswith("req-")  # client junk is not used as the id
    lines = _lines(captured)  # every line parses: client text cannot split one
    mine = [ln for ln in lines if ln["logger"] in ("gateway.test_route", "gateway.app")]
    assert len(mine) >= 6, lines
    assert all(ln.get("request_id") for ln in mine), mine
    first = [ln for ln in mine if ln.get("request_id") == "rid-42"]
    assert {ln["logger"] for ln in first} == {"gateway.test_route", "gateway.app"}
    assert any(ln["msg"] == 'handling a request for a\nb"c' for ln in first)
    assert any("exc" in ln and "RuntimeError" in str(ln["exc"]) for ln in first)  # the error line too
    assert any(ln.get("request_id") == generated for ln in mine)
    assert "the-secret-key" not in captured.getvalue()


def test_realtime_lines_carry_the_session_id(captured: io.StringIO) -> None:
    app = create_app(GatewayConfig(stage_addrs=DEAD))
    with TestClient(app) as client, client.websocket_connect("/v1/duplex") as ws:
        ws.send_json({"type": "session.update", "session": session_body()})
        created = ws.receive_json()
        session_id = created["session"]["id"]
    realtime = [ln for ln in _lines(captured) if str(ln["logger"]).startswith("gateway.realtime")]
    assert realtime, captured.getvalue()
    assert all(ln.get("request_id") == session_id for ln in realtime), realtime
