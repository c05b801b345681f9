"""End-to-end realtime tests: the gateway (uvicorn on loopback) in front of REAL thinker, talker and code2wav
stage servers on the tiny checkpoint. Nothing is faked: every response here was decided by the thinker's
duplex policy, voiced by the talker and vocalised by code2wav.

The random-weight model would mostly listen in the native lane, so responses are forced through the turn
lane (append, commit, ``response.create``), where the thinker must speak on the requested unit.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import time
import warnings
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from realtime_helpers import load_vllm_omni_duplex_client, pcm16_b64, response_metadata, session_body, tone
from realtime_invariants import check_response_invariants
from realtime_stages import REPO, STAGES, Conn, realtime_gateway, stage_servers

pytestmark = pytest.mark.slow

# The shared stages' thinker context: room for a 40-unit response that is barged in late (a slow first
# audio lets the thinker run many units ahead) and a second response in the same session.
THINKER_MAX_CONTEXT = 4096
# The S8 test's own stages: a context small enough that one session runs past it in seconds of audio.
SMALL_MAX_CONTEXT = 512


@pytest.fixture(scope="module")
def stage_addrs(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    logs = tmp_path_factory.mktemp("stage_logs")
    with stage_servers(tiny_ckpt, logs, thinker_args=["--max-context", str(THINKER_MAX_CONTEXT)]) as stages:
        yield stages.addrs


@pytest.fixture()
def small_context_url(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("small_context_logs")
    with stage_servers(tiny_ckpt, logs, thinker_args=["--max-context", str(SMALL_MAX_CONTEXT)]) as stages:
        with realtime_gateway(stages.addrs, seed=0, max_response_units=3) as url:
            yield url


@pytest.fixture(scope="module")
def gateway_url(stage_addrs: dict[str, str]) -> Iterator[str]:
    with realtime_gateway(stage_addrs, seed=0, max_response_units=3) as url:
        yield url


def _open(conn: Conn, **overrides: Any) -> dict[str, Any]:
    conn.send({"type": "session.update", "session": session_body(**overrides)})
    created = conn.until("session.created", 60)
    conn.until("session.updated", 60)
    return created


def _commit_speech(conn: Conn, seconds: float = 1.5) -> None:
    conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(seconds))})
    conn.send({"type": "input_audio_buffer.commit"})
    conn.until("conversation.item.done", 60)


def test_turn_lane_spoken_response(gateway_url: str) -> None:
    conn = Conn(f"{gateway_url}/v1/realtime?duplex=1")
    try:
        _open(conn)
        _commit_speech(conn)
        conn.send({"type": "response.create"})
        conn.until("rate_limits.updated")
        summary = check_response_invariants(conn.events)
        ((rid, info),) = summary.items()
        assert info["status"] == "completed"
        assert info["audio_deltas"] >= 1 and info["audio_bytes"] > 0
        # playback truth and history
        conn.send({"type": "playback.ack", "response_id": rid, "played_ms": 400})
        ack = conn.until("playback.acknowledged", 30)
        assert ack["event"]["item_id"] == "item_" + rid
        conn.send({"type": "conversation.item.retrieve", "item_id": "item_" + rid})
        item = conn.until("conversation.item.retrieved", 30)["item"]
        assert item["content"][0]["transcript"] == info["transcript"]
        conn.send({"type": "session.close"})
        closed = conn.until("session.closed", 30)
        assert closed["reason"] == "client_close"
        assert conn.events[-1]["type"] == "session.closed"
    finally:
        conn.close()


def test_barge_in_across_stages(gateway_url: str) -> None:
    """B2: after barge_in no audio of the cancelled response arrives; every stage acks the new epoch."""
    conn = Conn(f"{gateway_url}/v1/duplex")
    try:
        _open(conn, extra_body={"max_response_units": 40})
        _commit_speech(conn)
        conn.send({"type": "response.create"})
        first_audio = conn.until("response.output_audio.delta")
        rid = first_audio["response_id"]
        conn.send({"type": "barge_in"})
        sent_at = time.time()
        end = time.time() + 120
        stages_acked: dict[str, dict[str, Any]] = {}
        done_seen = False
        while time.time() < end and not (done_seen and len(stages_acked) == 3):
            event = conn.recv(max(0.1, end - time.time()))
            if event["type"] == "response.done" and event["response_id"] == rid and not done_seen:
                done_seen = True
                print(
                    f"barge-in: client-observed barge_in -> cancelled response.done {1000 * (time.time() - sent_at):.1f} ms"
                )
            if event["type"] == "duplex.stage_interrupt_ack":
                stages_acked[event["event"]["stage"]] = event["event"]
        assert done_seen
        print(f"barge-in: stage acks {stages_acked}")
        assert set(stages_acked) == set(STAGES), stages_acked
        assert all(a["epoch"] == 1 for a in stages_acked.values())
        # the stages report the old epoch's work dropped: the thinker had units queued or running
        assert sum(a["dropped_items"] for a in stages_acked.values()) >= 1
        # let any straggler arrive, then prove none of it belongs to the cancelled response
        conn.send({"type": "session.heartbeat"})
        conn.until("session.heartbeat_ack", 60)
        time.sleep(2.0)
        conn.send({"type": "session.heartbeat"})
        conn.until("session.heartbeat_ack", 60)
        summary = check_response_invariants(conn.events)
        info = summary[rid]
        assert info["status"] == "cancelled" and info["reason"] == "barge_in"
        md = response_metadata(info["done"])
        assert md["epoch"] == 1 and md["cancelled_epoch"] == 0
        # the session keeps working at the new epoch (with a short answer this time)
        conn.send({"type": "session.update", "session": {"extra_body": {"max_response_units": 2}}})
        conn.until("session.updated", 60)
        _commit_speech(conn)
        conn.send({"type": "response.create"})
        created = conn.until("response.created")
        assert response_metadata(created)["epoch"] == 1
        conn.until("rate_limits.updated")
        summary = check_response_invariants(conn.events)
        assert summary[created["response_id"]]["status"] == "completed"
        assert summary[created["response_id"]]["audio_bytes"] > 0
    finally:
        conn.close()


def test_native_lane_decisions_and_context_limit(small_context_url: str) -> None:
    """Native lane: every unit gets a model decision; past the thinker's context the session ends with the
    stable ``context_length_exceeded`` code (S8) while another session keeps working."""
    conn = Conn(f"{small_context_url}/v1/duplex")
    other = Conn(f"{small_context_url}/v1/duplex")
    try:
        _open(conn, extra_body={"auto_response": True})
        _open(other)
        seconds = SMALL_MAX_CONTEXT // 13 + 5  # a listen unit costs 13 tokens (docs/model.md)
        x = np.zeros(seconds * 16000, dtype=np.float32)
        for i in range(0, x.size, 8000):
            conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(x[i : i + 8000])})
        error = conn.until("error", 900)
        assert error["error"]["code"] == "context_length_exceeded"
        assert error["error"]["type"] == "invalid_request_error"
        closed = conn.until("session.closed", 60)
        assert closed["reason"] == "context_length_exceeded"
        decisions = [e for e in conn.events if e["type"] in ("response.listen", "response.created")]
        assert decisions, "the model decided nothing before the limit"
        check_response_invariants(conn.events)
        other.send({"type": "session.heartbeat"})
        assert other.until("session.heartbeat_ack", 60)["type"] == "session.heartbeat_ack"
    finally:
        conn.close()
        other.close()


def test_demo_client_end_to_end(gateway_url: str, tmp_path: Path) -> None:
    wav = tmp_path / "in.wav"
    ref = tmp_path / "ref.wav"
    for path, x in ((wav, tone(2.2)), (ref, tone(1.0, freq=180.0))):
        with wave.open(str(path), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(16000)
            w.writeframes((x * 32767).astype("<i2").tobytes())
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "realtime_duplex_demo.py"),
            "--url",
            f"{gateway_url}/v1/realtime",
            "--input-wav",
            str(wav),
            "--ref-audio",
            str(ref),
            "--output-dir",
            str(out),
            "--turn-lane",
            "--no-realtime",
            "--require-audio",
            "--timeout",
            "300",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "result.json").read_text())
    assert result["ok"] and result["session_closed"] and not result["errors"]
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    summary = check_response_invariants([{k: v for k, v in e.items() if k != "t"} for e in events])
    assert len(summary) == 1
    with wave.open(str(out / "reply.wav")) as w:
        assert w.getframerate() == 24000 and w.getnframes() * 1000 // 24000 == result["reply_audio_ms"] > 0


def test_vllm_omni_duplex_client(gateway_url: str, tmp_path: Path) -> None:
    duplex, preset = load_vllm_omni_duplex_client(tmp_path)
    from realtime_helpers import wav_data_uri

    async def run() -> tuple[list[Any], list[str]]:
        config = preset.create_duplex_session_config(
            ref_audio=wav_data_uri(tone(1.0, freq=180.0)), auto_response=False
        )
        handles: list[Any] = []
        audio: list[bytes] = []
        async with duplex.DuplexClient(gateway_url, model="openbmb/MiniCPM-o-4_5", config=config) as client:
            assert client.session_id and client.session_id.startswith("duplex-")
            pcm = (tone(1.5) * 32767).astype("<i2").tobytes()
            await client.stream_pcm(pcm, chunk_ms=200, realtime=False)
            await client.commit(create_response=True)
            async for handle in client.responses():
                handles.append(handle)
                async for chunk in handle.audio():
                    audio.append(chunk)
                await handle.wait(timeout_s=300)
                break
        return handles, [base64.b64encode(a).decode() for a in audio]

    handles, audio = asyncio.run(run())
    assert len(handles) == 1 and handles[0].decision == "speak"
    assert handles[0].done_event is not None
    assert sum(len(base64.b64decode(a)) for a in audio) > 0


def _stock_sdk_turn(gateway_url: str, modalities: list[str]) -> list[Any]:
    """One turn-lane exchange through the official ``openai`` SDK's realtime connection, GA session shape
    (``type: realtime``, ``audio.input.format`` 24 kHz PCM, no declared rate elsewhere), every event
    serialised through the SDK's models with warnings turned into errors."""
    openai = pytest.importorskip("openai")
    from realtime_helpers import wav_data_uri

    client = openai.OpenAI(
        api_key="unused",
        base_url=gateway_url.replace("ws://", "http://") + "/v1",
        websocket_base_url=gateway_url + "/v1",
    )
    session = {
        "type": "realtime",
        "output_modalities": modalities,
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}},
        "ref_audio": wav_data_uri(tone(1.0, freq=180.0)),
    }
    seen: list[Any] = []
    # The SDK's own websockets call warns (DeprecationWarning, websockets 17): not ours, so warnings turn
    # into errors only where our events meet the SDK's models.
    with client.realtime.connect(model="openbmb/MiniCPM-o-4_5", extra_query={"autostart": "0"}) as conn:
        conn.send({"type": "session.update", "session": session})
        deadline = time.time() + 300
        for event in conn:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a GA model that does not fit our event warns: fail on it
                event.model_dump()
                event.to_json()
            seen.append(event)
            if event.type == "session.updated" and len([e for e in seen if e.type == "session.updated"]) == 1:
                conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.2, rate=24000))})
                conn.send({"type": "input_audio_buffer.commit"})
                conn.send({"type": "response.create"})
            if event.type in ("response.done", "error") or time.time() > deadline:
                break
    return seen


def test_stock_openai_realtime_client_turn_lane(gateway_url: str) -> None:
    """The official ``openai`` SDK converses in the turn lane, unmodified and without a single model
    warning: GA audio formats, GA item content types, string response metadata, 24 kHz input."""
    seen = _stock_sdk_turn(gateway_url, ["audio", "text"])
    types = [e.type for e in seen]
    created = seen[0]
    assert created.type == "session.created"
    assert (
        created.session.audio.input.format.type == "audio/pcm"
        and created.session.audio.input.format.rate == 24000
    )
    assert (
        created.session.audio.output.format.type == "audio/pcm"
        and created.session.audio.output.format.rate == 24000
    )
    committed = next(e for e in seen if e.type == "conversation.item.done" and e.item.role == "user")
    assert committed.item.content[0].model_dump()["audio_ms"] == 1200  # 28 800 samples at 24 kHz = 1.2 s
    assert types.count("response.output_audio.delta") >= 1
    done = seen[-1]
    assert done.type == "response.done" and done.response.status == "completed"
    assert all(isinstance(v, str) for v in done.response.metadata.values())
    assert done.response.output[0].content[0].type == "output_audio"
    # Usage in thinker tokens: the session's context before the response (its prefix) is cached input.
    usage = done.response.usage
    assert (
        usage is not None
        and usage.output_tokens > 0
        and usage.input_tokens > usage.input_token_details.cached_tokens > 0
    )
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    part = next(e for e in seen if e.type == "response.content_part.done")
    assert part.part.type == "audio" and part.part.transcript == done.response.output[0].content[0].transcript


def test_stock_openai_realtime_client_text_only(gateway_url: str) -> None:
    seen = _stock_sdk_turn(gateway_url, ["text"])
    done = seen[-1]
    assert done.type == "response.done" and done.response.status == "completed", [e.type for e in seen]
    assert done.response.output[0].content[0].type == "output_text"
    assert "response.output_text.done" in [e.type for e in seen]


# Server VAD on synthetic tones: the energy fallback (Silero rightly hears no speech in a sine).
TONE_VAD = {"type": "server_vad", "silence_duration_ms": 400, "detector": "energy"}


def _stream(conn: Conn, x: np.ndarray, chunk_s: float = 0.2) -> None:
    step = int(chunk_s * 16000)
    for i in range(0, x.size, step):
        conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(x[i : i + step])})


def test_server_vad_speech_over_an_answer_without_barge_in_support(stage_addrs: dict[str, str]) -> None:
    """A deployment without barge-in: speech detected during an answer is reported as
    ``overlap.decision{action:"listen", reason:"barge_in_unsupported"}`` and the answer plays to its end."""
    with realtime_gateway(stage_addrs, seed=0, max_response_units=2, supports_barge_in=False) as url:
        conn = Conn(f"{url}/v1/realtime")
        try:
            _open(conn, turn_detection=TONE_VAD, overlap_policy="barge_in_on_speech")
            silence = np.zeros(int(0.4 * 16000), dtype=np.float32)
            _stream(conn, np.concatenate([silence, tone(1.2), silence, silence]))
            rid = conn.until("response.created", 60)["response_id"]
            conn.until("response.output_audio.delta")
            _stream(conn, tone(0.6, freq=330.0))  # the user talks over the answer
            conn.until("input_audio_buffer.speech_started", 60)
            decision = conn.until("overlap.decision", 60)
            assert decision["action"] == "listen" and decision["reason"] == "barge_in_unsupported"
            assert decision["metadata"]["response_id"] == rid
            done = conn.until("response.done", 120)
            assert done["response_id"] == rid and done["response"]["status"] == "completed"
            conn.until("rate_limits.updated")
            assert check_response_invariants(conn.events)[rid]["audio_bytes"] > 0
        finally:
            conn.close()


def test_server_vad_turns_and_barge_in(gateway_url: str) -> None:
    """turn_detection server_vad: a tone burst then silence is detected, committed and answered with audio;
    speech during that answer cancels it with reason ``turn_detected``; the next silence ends the new turn."""
    conn = Conn(f"{gateway_url}/v1/realtime")
    try:
        created = _open(
            conn,
            turn_detection=TONE_VAD,
            overlap_policy="barge_in_on_speech",
            extra_body={"max_response_units": 40},
        )
        assert created["session"]["turn_detection"]["silence_duration_ms"] == 400
        silence = np.zeros(int(0.4 * 16000), dtype=np.float32)
        _stream(conn, np.concatenate([silence, tone(1.2), silence, silence]))
        started = conn.until("input_audio_buffer.speech_started", 60)
        assert started["audio_start_ms"] == 100  # speech at 400 ms, 300 ms of prefix padding
        stopped = conn.until("input_audio_buffer.speech_stopped", 60)
        assert stopped["audio_end_ms"] == 1600 + 400 and stopped["item_id"] == started["item_id"]
        committed = conn.until("input_audio_buffer.committed", 60)
        assert committed["item_id"] == started["item_id"] and committed["event"]["message"] == "speech"
        first = conn.until("response.created", 60)
        rid = first["response_id"]
        conn.until("response.output_audio.delta")

        _stream(conn, tone(0.6, freq=330.0))  # the user talks over the answer
        barge = conn.until("input_audio_buffer.speech_started", 60)
        decision = conn.until("overlap.decision", 60)
        assert decision["action"] == "barge_in" and decision["reason"] == "server_vad_speech_started"
        assert decision["metadata"]["response_id"] == rid
        done = conn.until("response.done", 60)
        assert done["response_id"] == rid and done["response"]["status"] == "cancelled"
        assert done["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}

        conn.send({"type": "session.update", "session": {"extra_body": {"max_response_units": 2}}})
        conn.until("session.updated", 60)
        _stream(conn, np.concatenate([silence, silence]))
        stopped = conn.until("input_audio_buffer.speech_stopped", 60)
        assert stopped["item_id"] == barge["item_id"]
        second = conn.until("response.created", 60)
        assert response_metadata(second)["epoch"] == 1
        conn.until("rate_limits.updated")
        summary = check_response_invariants(conn.events)
        assert summary[rid]["status"] == "cancelled" and summary[rid]["audio_bytes"] > 0
        assert summary[second["response_id"]]["status"] == "completed"
        assert summary[second["response_id"]]["audio_bytes"] > 0
        types = [e["type"] for e in conn.events]
        assert types.index("input_audio_buffer.speech_stopped") < types.index("input_audio_buffer.committed")
    finally:
        conn.close()
