"""OpenAI's audio API through real stage processes (tiny checkpoint, CPU): ``/v1/audio/speech`` in every
format, SSE, speed and long input; the voice registry (register, list, use in speech and chat, delete,
survive a gateway restart); transcriptions and translations in every response format and streamed; and
every bad input as a 400 in the OpenAI envelope with ``param``."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import av
import httpx
import numpy as np
import pytest
import soundfile as sf
from gateway_server import ThreadedGateway
from stage_processes import StageProcess, start_stages, stop_all

from gateway.config import GatewayConfig
from services.common.deploy_profile import load_profile

pytestmark = pytest.mark.slow

MODEL = "openbmb/MiniCPM-o-4_5"
OVERRIDES = {
    "thinker": {"sampling": {"max_tokens": 8}},
    "talker": {"sampling": {"max_new_frames": 30, "min_new_frames": 0}},
}
TEXT = "Hello there. This sentence is read aloud exactly as written."


@pytest.fixture(scope="module")
def stages(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[StageProcess]]:
    procs = start_stages(
        tiny_ckpt,
        tmp_path_factory.mktemp("stage_logs"),
        [("thinker", ["--max-context", "900"]), ("talker", []), ("code2wav", [])],
    )
    try:
        yield procs
    finally:
        stop_all(procs)


def _config(stages: list[StageProcess], voice_dir: Path) -> GatewayConfig:
    # No extra tokens past the duration cap: a short clip's text is then visibly bounded by its length.
    gateway = {"voice_dir": str(voice_dir), "transcription": {"extra_tokens": 0}}
    overrides = {**OVERRIDES, "gateway": gateway}
    addrs = {p.stage: p.addr for p in stages}
    return GatewayConfig(stage_addrs=addrs, profile=load_profile("cpu").with_overrides(overrides))


@pytest.fixture(scope="module")
def voice_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("voices")


@pytest.fixture(scope="module")
def gateway(stages: list[StageProcess], voice_dir: Path) -> Iterator[ThreadedGateway]:
    with ThreadedGateway(_config(stages, voice_dir)) as gw:
        gw.wait_healthy(60)
        yield gw


def _voice_clip(seconds: float = 3.0, rate: int = 22050, pad_s: float = 0.5) -> bytes:
    """A voiced-like clip with silence around it (trimmed away by the registry)."""
    t = np.arange(int(seconds * rate)) / rate
    tone = 0.2 * np.sin(2 * np.pi * 150 * t) * (1 + 0.5 * np.sin(2 * np.pi * 4 * t))
    pad = np.zeros(int(pad_s * rate))
    buf = io.BytesIO()
    sf.write(buf, np.concatenate([pad, tone, pad]).astype(np.float32), rate, format="FLAC")
    return buf.getvalue()


def _speech(url: str, **body: object) -> httpx.Response:
    payload = {"model": MODEL, "input": TEXT, "response_format": "wav", **body}
    return httpx.post(f"{url}/v1/audio/speech", json=payload, timeout=300)


def _decoded_samples(data: bytes) -> tuple[int, int]:
    with av.open(io.BytesIO(data)) as container:
        rate = container.streams.audio[0].rate
        return sum(f.samples for f in container.decode(audio=0)), rate


def _error(resp: httpx.Response, status: int, param: str | None) -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    assert err["code"] == status or (
        isinstance(err["code"], str) and err["type"] == "invalid_request_error"
    ), err
    return err["message"]


# --------------------------------------------------------------------------------------------- speech
@pytest.mark.parametrize("fmt", ["wav", "pcm", "mp3", "flac", "opus", "aac"])
def test_speech_every_format(gateway: ThreadedGateway, fmt: str) -> None:
    resp = _speech(gateway.url, response_format=fmt, voice="alloy")
    assert resp.status_code == 200, resp.text
    mime = {"wav": "audio/wav", "pcm": "audio/pcm", "mp3": "audio/mpeg", "flac": "audio/flac"}
    mime |= {"opus": "audio/ogg", "aac": "audio/aac"}
    assert resp.headers["content-type"].startswith(mime[fmt])
    if fmt == "pcm":
        samples = np.frombuffer(resp.content, "<i2")
        assert samples.size > 2400 and np.abs(samples).max() > 0
        return
    frames, rate = _decoded_samples(resp.content)
    assert frames > 2400 and rate in (24000, 48000)


def test_speech_sse_and_speed(gateway: ThreadedGateway) -> None:
    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/audio/speech",
        json={"model": MODEL, "input": TEXT, "response_format": "pcm", "stream_format": "sse"},
        timeout=300,
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines() if line]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    done = events[-1]
    assert done["type"] == "speech.audio.done" and done["usage"]["output_tokens"] > 5
    import base64

    normal = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(normal) > 4800
    # speed 2: the same speech (seeded talker) in about half the time, as one raw pcm stream
    fast = _speech(gateway.url, response_format="pcm", speed=2.0).content
    assert 0.4 < len(fast) / len(normal) < 0.6


def test_speech_long_input_is_read_in_segments(gateway: ThreadedGateway) -> None:
    long_text = " ".join(f"Sentence number {i} is part of a long input." for i in range(20))
    assert len(long_text) > 800  # three segments of at most 400 characters
    one = _speech(gateway.url, input="Sentence number 1 is part of a long input.", response_format="pcm")
    many = _speech(gateway.url, input=long_text, response_format="pcm")
    assert many.status_code == 200
    assert len(many.content) >= 3 * len(one.content) * 0.5  # every segment spoke (no run dropped)


def test_speech_bad_inputs_are_400_with_param(gateway: ThreadedGateway) -> None:
    url = gateway.url
    _error(_speech(url, input=""), 400, "input")
    _error(_speech(url, input="   "), 400, "input")
    _error(_speech(url, input="x" * 4097), 400, "input")
    _error(_speech(url, speed=0.2), 400, "speed")
    _error(_speech(url, speed=4.5), 400, "speed")
    _error(_speech(url, response_format="ogg"), 400, "response_format")
    _error(_speech(url, stream_format="websocket"), 400, "stream_format")
    assert "nobody" in _error(_speech(url, voice="nobody"), 400, "voice")
    _error(_speech(url, model="tts-9"), 404, "model")
    resp = httpx.post(f"{url}/v1/audio/speech", content=b"{not json", timeout=30)
    assert resp.status_code == 400


# --------------------------------------------------------------------------------------------- voices
def test_voice_registry_end_to_end(
    gateway: ThreadedGateway, stages: list[StageProcess], voice_dir: Path
) -> None:
    url = gateway.url

    def register(name: str, data: bytes, **form: str) -> httpx.Response:
        files = {"file": ("clip.flac", data, "audio/flac")}
        return httpx.post(f"{url}/v1/audio/voices", data={"name": name, **form}, files=files, timeout=120)

    created = register("narrator", _voice_clip(), ref_text="a test voice")
    assert created.status_code == 200, created.text
    meta = created.json()
    assert (
        meta["name"] == "narrator" and 2.9 < meta["duration_s"] < 3.1 and meta["ref_text"] == "a test voice"
    )
    assert sorted(p.name for p in (voice_dir / "narrator").iterdir()) == [
        "clip.wav",
        "code2wav.pb",
        "meta.json",
        "thinker.pb",
    ]
    assert "exists" in _error(register("narrator", _voice_clip()), 409, "name")
    _error(register("alloy", _voice_clip()), 409, "name")
    _error(register("bad/name", _voice_clip()), 400, "name")
    _error(register("short", _voice_clip(0.5)), 400, "file")
    _error(register("long", _voice_clip(31.0, rate=8000)), 400, "file")
    _error(register("silent", _voice_clip(0.0, pad_s=2.0)), 400, "file")
    _error(register("notaudio", b"this is not audio at all" * 10), 400, "file")
    _error(register("empty", b""), 400, "file")
    missing = httpx.post(f"{url}/v1/audio/voices", files={"file": ("a.wav", _voice_clip())}, timeout=30)
    _error(missing, 400, "name")

    listed = httpx.get(f"{url}/v1/audio/voices", timeout=30).json()["data"]
    names = {v["name"]: v["type"] for v in listed}
    assert names["narrator"] == "uploaded" and names["alloy"] == "builtin" and names["default"] == "builtin"

    default = _speech(url, response_format="pcm")
    by_stage = {p.stage: p for p in stages}
    derived = {
        "thinker": ("minicpmo_thinker_reference_encodes_total", "minicpmo_thinker_voice_prefix_builds_total"),
        "code2wav": ("minicpmo_code2wav_stored_voice_loads_total", "minicpmo_code2wav_origin_setups_total"),
    }
    before = {(st, m): by_stage[st].counter(m) for st, names in derived.items() for m in names}
    cloned = _speech(url, response_format="pcm", voice="narrator")
    assert cloned.status_code == 200 and len(cloned.content) > 4800
    assert cloned.content != default.content  # the code2wav prompt (and the thinker prompt) differ
    first = {key: by_stage[key[0]].counter(key[1]) for key in before}
    twice = _speech(url, response_format="pcm", voice="narrator")
    assert twice.content == cloned.content
    # The first use derived the voice's state once per stage (the thinker's prefix, code2wav's device
    # features and flow prompt setup); the second derived nothing, and no stage encoded the clip again.
    assert {key: by_stage[key[0]].counter(key[1]) for key in before} == first
    assert (
        first[("thinker", "minicpmo_thinker_reference_encodes_total")]
        == before[("thinker", "minicpmo_thinker_reference_encodes_total")]
    )
    assert first[("code2wav", "minicpmo_code2wav_stored_voice_loads_total")] == (
        before[("code2wav", "minicpmo_code2wav_stored_voice_loads_total")] + 1
    )

    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "modalities": ["text", "audio"],
            "audio": {"voice": "narrator", "format": "wav"},
        },
        timeout=300,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["audio"]["data"]
    bad_chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "modalities": ["text", "audio"],
            "audio": {"voice": "nobody", "format": "wav"},
        },
        timeout=60,
    )
    assert "nobody" in _error(bad_chat, 400, "audio.voice")

    # A fresh gateway over the same directory (a restart, or another replica) serves the voice.
    with ThreadedGateway(_config(stages, voice_dir)) as other:
        other.wait_healthy(60)
        names = [v["name"] for v in httpx.get(f"{other.url}/v1/audio/voices", timeout=30).json()["data"]]
        assert "narrator" in names
        again = _speech(other.url, response_format="pcm", voice="narrator")
        assert again.status_code == 200 and again.content == cloned.content

    assert httpx.delete(f"{url}/v1/audio/voices/narrator", timeout=30).json()["deleted"] is True
    _error(_speech(url, voice="narrator"), 400, "voice")
    _error(httpx.delete(f"{url}/v1/audio/voices/narrator", timeout=30), 404, "name")
    assert not (voice_dir / "narrator").exists()


# ------------------------------------------------------------------------------------- transcriptions
def _speechy_wav(seconds: float, rate: int = 16000) -> bytes:
    """Tone bursts with pauses (the window splitter cuts in a pause)."""
    t = np.arange(int(seconds * rate)) / rate
    gate = (np.sin(2 * np.pi * 0.25 * t) > -0.3).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 220 * t) * gate).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


def _transcribe(url: str, data: bytes, route: str = "transcriptions", **form: str) -> httpx.Response:
    files = {"file": ("speech.wav", data, "audio/wav")}
    return httpx.post(f"{url}/v1/audio/{route}", data={"model": MODEL, **form}, files=files, timeout=300)


def test_transcription_formats_windows_and_stream(gateway: ThreadedGateway) -> None:
    url = gateway.url
    clip = _speechy_wav(4.0)
    body = _transcribe(url, clip).json()
    assert isinstance(body["text"], str) and body["text"] and body["usage"]["output_tokens"] >= 1
    text = _transcribe(url, clip, response_format="text")
    assert text.headers["content-type"].startswith("text/plain") and text.text.strip() == body["text"]

    # 35 s: windows of at most 20 s (the profile's window_s), cut in their last third, covering the clip
    verbose = _transcribe(url, _speechy_wav(35.0), response_format="verbose_json", language="en").json()
    assert verbose["duration"] == pytest.approx(35.0, abs=0.01) and verbose["language"] == "en"
    segs = verbose["segments"]
    assert len(segs) in (2, 3) and segs[0]["start"] == 0
    assert segs[-1]["end"] == pytest.approx(35.0, abs=0.01)
    assert all(a["end"] == b["start"] for a, b in zip(segs, segs[1:], strict=False))
    assert all(13.3 <= s["end"] - s["start"] <= 20 for s in segs[:-1])
    assert verbose["text"] == " ".join(s["text"] for s in segs if s["text"])

    # A window's text is bounded by its duration: 0.5 s may have ceil(7.5 x 0.5) = 4 tokens (extra 0 here).
    short = _transcribe(url, _speechy_wav(0.5)).json()
    assert 1 <= short["usage"]["output_tokens"] <= 4

    srt = _transcribe(url, clip, response_format="srt").text
    assert srt.startswith("1\n00:00:00,000 --> 00:00:04,000\n")
    vtt = _transcribe(url, clip, response_format="vtt")
    assert vtt.text.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:04.000\n")

    with httpx.stream(
        "POST",
        f"{url}/v1/audio/transcriptions",
        data={"model": MODEL, "stream": "true"},
        files={"file": ("speech.wav", clip, "audio/wav")},
        timeout=300,
    ) as r:
        assert r.status_code == 200
        events = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines() if line]
    assert events[-1]["type"] == "transcript.text.done"
    deltas = "".join(e["delta"] for e in events[:-1] if e["type"] == "transcript.text.delta")
    assert deltas.strip() == events[-1]["text"] == body["text"]  # greedy: the same text

    translated = _transcribe(url, clip, route="translations", response_format="verbose_json").json()
    assert translated["task"] == "translate" and translated["language"] == "english"


def test_transcription_bad_inputs_are_400_with_param(gateway: ThreadedGateway) -> None:
    url = gateway.url
    clip = _speechy_wav(2.0)
    _error(_transcribe(url, clip, response_format="docx"), 400, "response_format")
    _error(_transcribe(url, clip, temperature="3"), 400, "temperature")
    _error(_transcribe(url, b""), 400, "file")
    _error(_transcribe(url, b"plain text, not audio" * 20), 400, "file")
    _error(_transcribe(url, clip, model="whisper-9"), 404, "model")
    resp = httpx.post(f"{url}/v1/audio/transcriptions", data={"model": MODEL}, timeout=30)
    _error(resp, 400, "file")
    _error(_transcribe(url, clip, route="translations", response_format="docx"), 400, "response_format")


def test_openapi_declares_the_audio_routes(gateway: ThreadedGateway) -> None:
    schema = httpx.get(f"{gateway.url}/openapi.json", timeout=30).json()
    paths = schema["paths"]
    speech = paths["/v1/audio/speech"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert speech["$ref"].endswith("/SpeechRequest")
    props = schema["components"]["schemas"]["SpeechRequest"]["properties"]
    assert {"input", "voice", "response_format", "speed", "instructions", "stream_format"} <= props.keys()
    for path in ("/v1/audio/transcriptions", "/v1/audio/translations", "/v1/audio/voices"):
        body = paths[path]["post"]["requestBody"]["content"]
        assert "multipart/form-data" in body
    assert "get" in paths["/v1/audio/voices"] and "delete" in paths["/v1/audio/voices/{name}"]


# ------------------------------------------------------------------------------------------- realtime
def test_realtime_session_voice_uses_a_registered_voice(stages: list[StageProcess], tmp_path: Path) -> None:
    from gateway_server import serve_in_thread
    from realtime_helpers import pcm16_b64, session_body, tone
    from realtime_stages import Conn

    from gateway.app import create_app

    app = create_app(_config(stages, tmp_path / "voices"))
    app.state.realtime_settings.seed = 0
    app.state.realtime_settings.max_response_units = 3
    with serve_in_thread(app) as port:
        url = f"http://127.0.0.1:{port}"
        files = {"file": ("clip.flac", _voice_clip(), "audio/flac")}
        assert httpx.post(
            f"{url}/v1/audio/voices", data={"name": "host"}, files=files, timeout=120
        ).is_success

        thinker = next(p for p in stages if p.stage == "thinker")
        encodes = thinker.counter("minicpmo_thinker_reference_encodes_total")
        body = session_body(voice="host")
        del body["ref_audio"]  # the registered voice supplies the reference
        conn = Conn(f"ws://127.0.0.1:{port}/v1/realtime?duplex=1")
        try:
            conn.send({"type": "session.update", "session": body})
            conn.until("session.updated", 60)
            conn.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(tone(1.5))})
            conn.send({"type": "input_audio_buffer.commit"})
            conn.until("conversation.item.done", 60)
            conn.send({"type": "response.create"})
            delta = conn.until("response.output_audio.delta", 300)
            assert delta["delta"]
        finally:
            conn.close()
        # The session's thinker took the voice's stored rows: the clip was not encoded again.
        assert thinker.counter("minicpmo_thinker_reference_encodes_total") == encodes

        bad = session_body(voice="nobody")
        del bad["ref_audio"]
        conn = Conn(f"ws://127.0.0.1:{port}/v1/realtime?duplex=1")
        try:
            conn.send({"type": "session.update", "session": bad})
            err = conn.until("error", 60)["error"]
            assert err["code"] == "invalid_voice" and err["param"] == "voice" and "nobody" in err["message"]
        finally:
            conn.close()


# ------------------------------------------------------------------------------------------- examples
def test_example_clients_with_the_stock_sdk(gateway: ThreadedGateway, tmp_path: Path) -> None:
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    base = f"{gateway.url}/v1"
    clip = tmp_path / "me.flac"
    clip.write_bytes(_voice_clip())
    out = tmp_path / "hello.wav"
    run = subprocess.run(
        [sys.executable, "examples/speech_client.py", "Hello there.", "--base-url", base, "--format", "wav"]
        + [
            "--output",
            str(out),
            "--register-voice",
            "sdkvoice",
            "--voice-clip",
            str(clip),
            "--voice",
            "sdkvoice",
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "registered voice 'sdkvoice'" in run.stdout and "first byte" in run.stdout
    frames, rate = _decoded_samples(out.read_bytes())
    assert frames > 2400 and rate == 24000
    listed = subprocess.run(
        [sys.executable, "examples/speech_client.py", "--base-url", base, "--list-voices"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "sdkvoice" in listed.stdout and "alloy" in listed.stdout
    assert httpx.delete(f"{gateway.url}/v1/audio/voices/sdkvoice", timeout=30).is_success

    audio = tmp_path / "speech.wav"
    audio.write_bytes(_speechy_wav(3.0))
    for extra in (["--format", "verbose_json"], ["--format", "srt"], ["--stream"], ["--translate"]):
        run = subprocess.run(
            [sys.executable, "examples/transcribe_client.py", str(audio), "--base-url", base, *extra],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, (extra, run.stderr)
        assert run.stdout.strip(), extra
        if extra[-1] == "verbose_json":
            assert json.loads(run.stdout)["segments"][0]["end"] == pytest.approx(3.0, abs=0.01)
        if extra[-1] == "srt":
            assert run.stdout.startswith("1\n00:00:00,000 --> 00:00:03,000")
