"""Shared helpers for the realtime WebSocket tests: WAV data URIs, PCM, and a session opener."""

from __future__ import annotations

import base64
import io
import json
import re
import wave
from typing import Any

import numpy as np

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
