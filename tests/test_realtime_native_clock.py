"""The native lane after the client's last word, and input backpressure, through the REAL stages.

* Clock rule (docs/realtime.md "Lanes"): after ``input_audio_buffer.commit`` with ``final: true`` the
  client sends nothing more, yet an active native response must still finish. The session feeds the
  model 1 s silent units (one each time the thinker has decided every unit sent) until the model ends
  its turn or ``max_response_units`` silent units have run; then ``response.done`` as usual. With the
  random weights of the tiny checkpoint the model practically never ends a turn, so here the cap ends it.
* Backpressure (docs/protocol.md, Realtime input): input is pending until the thinker has decided its unit, so
  a flood is refused with ``input_backpressure`` instead of queueing toward the thinker without bound.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import subprocess
import sys
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from realtime_helpers import load_vllm_omni_duplex_client, pcm16_b64, session_body, tone, wav_data_uri
from realtime_stages import REPO, Conn, RunningStages, realtime_gateway, stage_servers

pytestmark = pytest.mark.slow

CAP = 2  # max_response_units of the test gateway: the silent units a native response may run on


# A small sliding window, so that a short input-clocked session trims several times (the shipped
# profiles use 8000 / 6000; the rule is the same).
WINDOW = ["--duplex-window", "basic", "--duplex-window-high", "600", "--duplex-window-low", "400"]


@pytest.fixture(scope="module")
def stages(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStages]:
    with stage_servers(
        tiny_ckpt, tmp_path_factory.mktemp("clock_stage_logs"), thinker_args=WINDOW
    ) as running:
        yield running


@pytest.fixture(scope="module")
def gateway_url(stages: RunningStages) -> Iterator[str]:
    with realtime_gateway(stages.addrs, seed=0, max_response_units=CAP) as url:
        yield url


def _metric(url: str, name: str) -> float:
    """The sample ``name`` (with its labels, if any) on a stage's /metrics page, 0 when absent."""
    pattern = re.compile(rf"^{re.escape(name)}\s+(\S+)$", re.M)
    return sum(float(v) for v in pattern.findall(httpx.get(url, timeout=10).text))


DECIDED = 'minicpmo_thinker_duplex_unit_seconds_count{phase="engine"}'  # units the thinker has decided


def _write_wav(path: Path, x: np.ndarray, rate: int) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())
    return path


def test_readme_demo_command_finishes_its_reply(gateway_url: str, tmp_path: Path) -> None:
    """README "Using it": the demo command as written (native lane, one WAV, real-time pacing)."""
    question = _write_wav(tmp_path / "question.wav", tone(2.5, freq=300.0), 16_000)
    voice = _write_wav(tmp_path / "voice.wav", tone(1.0, freq=180.0), 16_000)
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "examples/realtime_duplex_demo.py",
            "--url",
            f"{gateway_url}/v1/realtime?duplex=1",
            "--input-wav",
            str(question),
            "--ref-audio",
            str(voice),
            "--output-dir",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    result = json.loads((out / "result.json").read_text())
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    story = [
        (
            e["t"],
            e["type"],
            e.get("response_id"),
            (e.get("metadata") or {}).get("end_of_turn"),
            e.get("error"),
        )
        for e in events
        if e["type"] not in ("response.output_audio_transcript.delta", "rate_limits.updated")
    ]
    brief = {k: v for k, v in result.items() if k != "responses"}
    brief["responses"] = [
        {k: r[k] for k in ("response_id", "status", "decision", "audio_ms")} for r in result["responses"]
    ]
    assert proc.returncode == 0 and result["ok"] is True, (brief, story[-60:])
    spoken = [r for r in result["responses"] if r["decision"] == "speak"]
    assert spoken, "the model never spoke: the test would not show the clock"
    assert all(r["status"] == "completed" for r in result["responses"])
    commit_at = next(i for i, e in enumerate(events) if e["type"] == "input_audio_buffer.committed")
    last = spoken[-1]["response_id"]
    deltas = [e for e in events if e["type"] == "response.output_audio.delta" and e["response_id"] == last]
    assert deltas[-1]["metadata"]["end_of_turn"] is True  # the reply ran to its end, not cut off
    done_at = max(i for i, e in enumerate(events) if e["type"] == "response.done")
    assert done_at > commit_at
    # The whole reply is saved: reply.wav holds every audio delta of every response, in order.
    with wave.open(str(out / "reply.wav")) as w:
        saved = w.readframes(w.getnframes())
    sent = b"".join(
        base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta"
    )
    assert saved == sent and len(saved) > 0
    # The response that spoke at the end went on past the input (2.5 s = 3 units) on silent units.
    assert deltas[-1]["metadata"]["audio_duration_ms"] >= 1000


def test_vllm_omni_duplex_client_native_lane_every_response_completes(
    gateway_url: str, tmp_path: Path
) -> None:
    """vLLM-Omni's own ``DuplexClient`` (unmodified, from its wheel) streams a WAV in the native lane."""
    duplex, preset = load_vllm_omni_duplex_client(tmp_path)

    async def run() -> list[Any]:
        config = preset.create_duplex_session_config(
            ref_audio=wav_data_uri(tone(1.0, freq=180.0)), auto_response=True
        )
        handles: list[Any] = []
        async with duplex.DuplexClient(gateway_url, model="openbmb/MiniCPM-o-4_5", config=config) as client:
            pcm = (tone(2.5, freq=300.0) * 32767).astype("<i2").tobytes()
            await client.stream_pcm(pcm, chunk_ms=200, realtime=True)
            await client.commit()
            async for handle in client.responses():
                handles.append(handle)
                async for _chunk in handle.audio():
                    pass
                await handle.wait(timeout_s=300)
                if handle.decision == "speak":
                    break
        return handles

    handles = asyncio.run(run())
    spoken = [h for h in handles if h.decision == "speak"]
    assert spoken, [h.decision for h in handles]
    assert all(h.done_event is not None for h in handles)
    # The client's done_event wraps the terminal server event: response.done, completed, for a reply.
    assert all(h.done_event.type == "response.done" for h in spoken)
    assert all(h.done_event.raw["response"]["status"] == "completed" for h in spoken)


def test_flood_gets_input_backpressure_and_loses_nothing_accepted(
    gateway_url: str, stages: RunningStages
) -> None:
    """20 MiB of PCM16 in well under a second: appends are refused once pending input (uncommitted plus
    sent to the thinker and not decided yet) would pass 16 MiB; every unit accepted before that is still
    decided by the model, and the session ends normally (no context_length_exceeded)."""
    thinker_units = _metric(stages.metrics_urls["thinker"], DECIDED)
    conn = Conn(f"{gateway_url}/v1/realtime?duplex=1")
    try:
        conn.send(
            {
                "type": "session.update",
                "session": session_body(
                    modalities=["text"], extra_body={"auto_response": True, "force_listen_count": 0}
                ),
            }
        )
        conn.until("session.updated", timeout=60)
        piece = base64.b64encode((tone(8.0) * 32767).astype("<i2").tobytes()).decode()  # 256 000 bytes
        appends = (20 << 20) // 256_000 + 1
        for i in range(appends):
            conn.send({"type": "input_audio_buffer.append", "audio": piece, "event_id": f"event_{i:032x}"})
        conn.send({"type": "input_audio_buffer.commit", "final": False, "event_id": "event_" + "c" * 32})
        conn.until("input_audio_buffer.committed", timeout=300)
        errors = [e for e in conn.events if e["type"] == "error"]
        assert errors and {e["error"]["code"] for e in errors} == {"input_backpressure"}, errors
        accepted = appends - len(errors)
        assert accepted >= 1
        # Every accepted unit reaches the thinker and is decided there (none dropped, none queued forever).
        want = thinker_units + accepted * 8
        deadline = time.monotonic() + 600
        while _metric(stages.metrics_urls["thinker"], DECIDED) < want:
            assert time.monotonic() < deadline, "accepted units were never decided"
            with contextlib.suppress(TimeoutError):
                conn.recv(timeout=1.0)  # keep reading: an unread socket would stall the client's keepalive
        conn.send({"type": "session.close"})
        conn.until("session.closed", timeout=300)
        assert not [
            e for e in conn.events if e["type"] == "error" and e["error"]["code"] != "input_backpressure"
        ]
    finally:
        conn.close()
    assert _metric(stages.metrics_urls["thinker"], DECIDED) == want


def test_an_input_clocked_session_trims_its_context_and_replies_keep_their_order(
    gateway_url: str, stages: RunningStages
) -> None:
    """Turn after turn as fast as the model answers, past the window twice: no context_length_exceeded,
    every response gets its own id, completes, and responses follow one another in order."""
    trims = _metric(stages.metrics_urls["thinker"], "minicpmo_thinker_duplex_window_trims_total")
    conn = Conn(f"{gateway_url}/v1/realtime?duplex=1")
    turns: list[str] = []
    try:
        conn.send({"type": "session.update", "session": session_body(modalities=["text"])})
        conn.until("session.updated", timeout=60)
        for turn in range(40):
            conn.send(
                {"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(3.0, freq=200.0 + 20 * turn))}
            )
            conn.send({"type": "input_audio_buffer.commit", "response_create": True})
            done = conn.until("response.done", timeout=300)
            assert done["response"]["status"] == "completed", done
            turns.append(done["response_id"])
            if (
                _metric(stages.metrics_urls["thinker"], "minicpmo_thinker_duplex_window_trims_total")
                >= trims + 2
            ):
                break
        trimmed = (
            _metric(stages.metrics_urls["thinker"], "minicpmo_thinker_duplex_window_trims_total") - trims
        )
        assert trimmed >= 2, f"{len(turns)} turns trimmed the context {trimmed} times"
        # One more turn after the last trim still answers.
        conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(3.0))})
        conn.send({"type": "input_audio_buffer.commit", "response_create": True})
        turns.append(conn.until("response.done", timeout=300)["response_id"])
        conn.send({"type": "session.close"})
        conn.until("session.closed", timeout=300)
    finally:
        conn.close()
    assert not [e for e in conn.events if e["type"] == "error"]
    assert len(set(turns)) == len(turns)  # identity: each reply its own response id
    created = [e["response_id"] for e in conn.events if e["type"] == "response.created"]
    assert created == turns  # order: replies are created and done in the order of the turns
    current = None  # every response-scoped event belongs to the response between its created and done
    for event in conn.events:
        if event["type"] == "response.created":
            assert current is None
            current = event["response_id"]
        elif "response_id" in event and event["type"].startswith("response."):
            assert event["response_id"] == current, event["type"]
            if event["type"] == "response.done":
                current = None
