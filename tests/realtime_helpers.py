"""Shared helpers for the realtime WebSocket tests: WAV data URIs, PCM, and a session opener."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import subprocess
import sys
import wave
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gateway.realtime.response_options import ResponseOptions

EVENT_ID_RE = re.compile(r"^event_[0-9a-f]{32}$")
SESSION_ID_RE = re.compile(r"^duplex-[0-9a-f]{32}$")


def tone(seconds: float, rate: int = 16_000, freq: float = 220.0, amp: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def pcm16_b64(x: np.ndarray) -> str:
    return base64.b64encode((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()).decode()


def response_metadata(event: dict[str, Any]) -> dict[str, Any]:
    """``event["response"]["metadata"]`` decoded: the server sends every value as a string (GA's type),
    objects and numbers as JSON text."""
    out: dict[str, Any] = {}
    for key, value in (event["response"].get("metadata") or {}).items():
        try:
            out[key] = json.loads(value)
        except (TypeError, ValueError):
            out[key] = value
    return out


def wav_data_uri(x: np.ndarray, rate: int = 16_000) -> str:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())
    return "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()


def session_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "openbmb/MiniCPM-o-4_5",
        "modalities": ["audio", "text"],
        "input_audio_format": "pcm16",
        "output_audio_format": "pcm16",
        "sample_rate_hz": 16000,
        "turn_detection": None,
        "ref_audio": wav_data_uri(tone(1.0, freq=180.0)),
        "overlap_policy": "listen_only",
        "playback_commit_policy": "ack_only",
    }
    body.update(overrides)
    return body


def receive_until(ws: Any, type_: str, limit: int = 5000) -> list[dict[str, Any]]:
    """Events up to and including the first of ``type_`` (starlette TestClient websocket)."""
    seen: list[dict[str, Any]] = []
    for _ in range(limit):
        event = ws.receive_json()
        seen.append(event)
        if event["type"] == type_:
            return seen
    raise AssertionError(f"no {type_} within {limit} events: {[e['type'] for e in seen]}")


def load_vllm_omni_duplex_client(tmp_path: Path) -> Any:
    """Import ``vllm_omni/clients/duplex.py`` unmodified from the vllm-omni 0.30.0 wheel."""
    wheel = os.environ.get("VLLM_OMNI_WHEEL")
    if not wheel:
        dl = tmp_path / "wheel"
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "vllm-omni==0.30.0", "--no-deps", "-d", str(dl)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        found = list(dl.glob("vllm_omni-0.30.0-*.whl"))
        if proc.returncode != 0 or not found:
            pytest.skip(f"vllm-omni 0.30.0 wheel not available: {proc.stderr[-300:]}")
        wheel = str(found[0])
    root = tmp_path / "pkgs"
    with zipfile.ZipFile(wheel) as zf:
        for name in (
            "vllm_omni/clients/duplex.py",
            "vllm_omni/clients/utils.py",
            "vllm_omni/clients/minicpmo_4_5.py",
        ):
            zf.extract(name, root)
    for pkg in ("vllm_omni", "vllm_omni/clients"):
        (root / pkg / "__init__.py").write_text("")  # only the client modules, none of the server code
    try:
        import pybase64  # noqa: F401
    except ImportError:
        # The client imports pybase64 (a faster drop-in of base64); the stdlib module has the same API.
        (root / "pybase64.py").write_text("from base64 import b64decode, b64encode  # noqa: F401\n")
    sys.path.insert(0, str(root))
    import vllm_omni.clients.duplex as duplex
    import vllm_omni.clients.minicpmo_4_5 as preset

    return duplex, preset


class QuietPipeline:
    """The session-facing calls of a scripted test pipeline that need no answer (``SessionPipeline``);
    a scripted pipeline subclasses it and writes ``push_unit`` (and ``close`` when it matters)."""

    def begin_response(self, options: ResponseOptions) -> None:
        pass

    def add_tool_output(self, output: str) -> None:
        pass

    def allow_speech_from(self, unit_seq: int, first_unit_of_request: int) -> None:
        pass

    def end_speech(self, epoch: int, speech_turn: int = 0) -> None:
        pass

    def interrupt(self, new_epoch: int, reason: str) -> None:
        pass

    async def close(self) -> None:
        pass
