"""The gateway's orchestration against scripted stage fakes (real gRPC + real HTTP, no model).

These check what the gateway itself promises - ordering, streaming shape, cleanup on disconnect,
retry, error mapping, limits - independently of the model stages; the end-to-end module repeats the
client-visible checks against the real stage processes.
"""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Iterator

import httpx
import pytest
import soundfile as sf
from gateway_fakes import SAMPLES_PER_FRAME, FakeStages
from gateway_server import ThreadedGateway
from media_samples import data_url, mp4_bytes, png_bytes, wav_bytes

from gateway.config import GatewayConfig
from services.common.deploy_profile import load_profile

MODEL = "openbmb/MiniCPM-o-4_5"


@pytest.fixture(scope="module")
def fakes() -> Iterator[FakeStages]:
    stages = FakeStages()
    yield stages
    stages.stop()


@pytest.fixture(scope="module")
def media_root(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("media")
    (root / "tone.wav").write_bytes(wav_bytes(0.5))
    return root


@pytest.fixture(scope="module")
def gateway(fakes: FakeStages, media_root) -> Iterator[ThreadedGateway]:
    profile = load_profile("cpu").with_overrides({"gateway": {"max_body_bytes": 2_000_000}})
    config = GatewayConfig(stage_addrs=fakes.addrs, profile=profile, allowed_media_root=media_root,
                           max_concurrent_requests=3)
    with ThreadedGateway(config) as gw:
        yield gw


@pytest.fixture(autouse=True)
def _reset(fakes: FakeStages) -> None:
    fakes.thinker.tokens = 6
    fakes.thinker.token_delay_s = 0.0


def _chat(content, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def _wait_idle(fakes: FakeStages, timeout: float = 10.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(fakes.active().values()):
            break
        time.sleep(0.05)
    return fakes.active()


def test_text_only_never_opens_speech_stages(gateway: ThreadedGateway, fakes: FakeStages) -> None:
    talker_opens = len(fakes.logs["talker"].opens)
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat("hi", modalities=["text"]), timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "[text] t0 t1 t2 t3 t4 t5 "
    assert "audio" not in body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13}
    assert len(fakes.logs["talker"].opens) == talker_opens
    opened = fakes.logs["thinker"].opens[-1]
    assert not opened.want_speech and not opened.use_tts_template
    assert opened.sampling.max_tokens == 24  # the cpu profile's default reached the thinker


def test_text_and_audio_non_streaming(gateway: ThreadedGateway, fakes: FakeStages) -> None:
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat("hi", modalities=["text", "audio"]), timeout=30)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    audio = choice["message"]["audio"]
    assert audio["transcript"] == "" and audio["id"].startswith("audio-") and len(audio["id"]) == 22
    wav = base64.b64decode(audio["data"])
    info = sf.info(io.BytesIO(wav))
    assert (info.samplerate, info.channels, info.subtype, info.format) == (24000, 1, "PCM_16", "WAV")
    assert info.frames == choice["audio_metadata"]["frame_count"] == 12 * SAMPLES_PER_FRAME
    # identity on every message: the talker saw the thinker's chunks in order, with the request id
    talker_open = fakes.logs["talker"].opens[-1]
    assert talker_open.id.request_id.startswith("chatcmpl-")
    assert (talker_open.window_frames, talker_open.left_context) == (25, 3)
    assert fakes.talker.chunk_ids[-3:] == [[100, 101], [102, 103], [104, 105]]


def test_talker_starts_on_first_speech_chunk(gateway: ThreadedGateway, fakes: FakeStages) -> None:
    fakes.thinker.token_delay_s = 0.15
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat("hi"), timeout=30)
    assert r.status_code == 200
    thinker, talker = fakes.logs["thinker"], fakes.logs["talker"]
    talker_open = talker.events[[e for _, e in talker.events].index("open", len(talker.events) - 2)][0]
    thinker_done = max(t for t, e in thinker.events if e == "done")
    assert talker_open < thinker_done - 0.3, "talker must start while the thinker is still generating"


def test_streaming_shape(gateway: ThreadedGateway) -> None:
    payload = _chat("hi", stream=True, stream_options={"include_usage": True}, audio={"format": "pcm16"})
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=payload, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content_chunks = [c for c in chunks if c["choices"]]
    assert all(c["modality"] in ("text", "audio") for c in content_chunks)
    finishing = [c for c in content_chunks if c["choices"][0].get("finish_reason")]
    assert len(finishing) == 1 and finishing[0] is content_chunks[-1]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 13
    audio_chunks = [c for c in content_chunks if c["modality"] == "audio" and c["choices"][0]["delta"].get("content")]
    pcm = b"".join(base64.b64decode(c["choices"][0]["delta"]["content"]) for c in audio_chunks)
    frames = sum(c["choices"][0]["audio_metadata"]["frame_count"] for c in audio_chunks)
    assert len(pcm) == 2 * frames == 2 * 12 * SAMPLES_PER_FRAME
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content_chunks if c["modality"] == "text")
    assert text == "[text] t0 t1 t2 t3 t4 t5 "


def test_openai_sdk_streaming_and_media(gateway: ThreadedGateway, media_root) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused")
    content = [
        {"type": "image_url", "image_url": {"url": data_url(png_bytes(), "image/png")}},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes(1.0)).decode(), "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": "file://" + str(media_root / "tone.wav")}},
        {"type": "video_url", "video_url": {"url": data_url(mp4_bytes(3.0), "video/mp4")}},
        {"type": "text", "text": "describe"},
    ]
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          modalities=["text"])
    text = resp.choices[0].message.content
    assert text.startswith("[image(89504e47) audio(16000Hz,1.00s) audio(16000Hz,0.50s) "
                           "video(frames=3,soundtrack=16000Hz) text]")
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
    finish = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]


def test_client_disconnect_cancels_every_stage(gateway: ThreadedGateway, fakes: FakeStages) -> None:
    fakes.thinker.tokens = 200
    fakes.thinker.token_delay_s = 0.05
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=_chat("hi", stream=True, max_tokens=200), timeout=30) as r:
        seen_audio = False
        for line in r.iter_lines():
            if '"modality":"audio"' in line:
                seen_audio = True
                break
        assert seen_audio
        assert all(v >= 1 for v in fakes.active().values())
    assert _wait_idle(fakes, timeout=3.0) == {"thinker": 0, "talker": 0, "code2wav": 0}


def test_retry_once_before_first_output(gateway: ThreadedGateway, fakes: FakeStages) -> None:
    fakes.thinker.fail_unavailable_once = True
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat("hi", modalities=["text"]), timeout=30)
    assert r.status_code == 200, r.text
    assert not fakes.thinker.fail_unavailable_once


def test_stage_error_maps_to_400_with_param(gateway: ThreadedGateway) -> None:
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat("FAIL_INVALID"), timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == 400 and err["param"] == "messages[0]" and "refuses" in err["message"]


def test_concurrency_limit_429(gateway: ThreadedGateway, fakes: FakeStages) -> None:
    fakes.thinker.tokens = 200
    fakes.thinker.token_delay_s = 0.05
    streams = []
    client = httpx.Client(timeout=30)
    try:
        for _ in range(3):
            s = client.stream("POST", f"{gateway.url}/v1/chat/completions", json=_chat("hi", stream=True, max_tokens=200))
            resp = s.__enter__()
            assert resp.status_code == 200
            streams.append(s)
        r = httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat("hi"), timeout=30)
        assert r.status_code == 429 and r.json()["error"]["code"] == 429
    finally:
        for s in streams:
            s.__exit__(None, None, None)
        client.close()
    assert _wait_idle(fakes, timeout=3.0) == {"thinker": 0, "talker": 0, "code2wav": 0}


@pytest.mark.parametrize(
    "payload, status, param",
    [
        (b"{not json", 400, None),
        (_chat("hi", model="other/model"), 404, "model"),
        (_chat("hi", modalities="text"), 400, "modalities"),
        (_chat("hi", modalities=["video"]), 400, "modalities"),
        (_chat("hi", audio={"format": "aac"}), 400, "audio.format"),
        (_chat("hi", temperature="hot"), 400, "temperature"),
        (_chat("hi", ref_audio=5), 400, "ref_audio"),
        ({"model": MODEL, "messages": "hi"}, 400, "messages"),
        (_chat([{"type": "image_url", "image_url": {"url": data_url(b"not an image", "image/png")}}]), 400,
         "messages[0].content[0]"),
        (_chat([{"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFFjunk").decode()}}]), 400,
         "messages[0].content[0]"),
        (_chat([{"type": "video_url", "video_url": {"url": data_url(b"\x00" * 64, "video/mp4")}}]), 400,
         "messages[0].content[0]"),
        (_chat([{"type": "input_audio", "input_audio": {"data": "%%%not-base64"}}]), 400,
         "messages[0].content[0].input_audio.data"),
        (_chat([{"type": "audio_url", "audio_url": {"url": "file:///etc/passwd"}}]), 403,
         "messages[0].content[0].audio_url.url"),
        (_chat([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]), 403,
         "messages[0].content[0].image_url.url"),
        (_chat("x" * 2_100_000), 413, None),
        (_chat("hi", sampling_params_list=[{"temprature": 1}]), 400, "sampling_params_list[0].temprature"),
    ],
)
def test_bad_inputs_get_the_envelope(gateway: ThreadedGateway, payload, status: int, param) -> None:
    if isinstance(payload, bytes):
        r = httpx.post(f"{gateway.url}/v1/chat/completions", content=payload,
                       headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(f"{gateway.url}/v1/chat/completions", json=payload, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == param
    assert httpx.get(f"{gateway.url}/health", timeout=10).status_code == 200


def test_models_health_metrics(gateway: ThreadedGateway) -> None:
    models = httpx.get(f"{gateway.url}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    health = httpx.get(f"{gateway.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "healthy"
    text = httpx.get(f"{gateway.url}/metrics").text
    for name in ("minicpmo_gateway_requests_total", "minicpmo_gateway_time_to_first_token_seconds_bucket",
                 "minicpmo_gateway_time_to_first_audio_seconds_bucket", "minicpmo_gateway_real_time_factor_bucket",
                 "minicpmo_gateway_stage_errors_total"):
        assert name in text


def test_api_key_and_stage_down() -> None:
    """A separate gateway: API key required; a stopped stage gives /health 503 and chat 503."""
    fakes = FakeStages()
    try:
        config = GatewayConfig(stage_addrs=fakes.addrs, profile=load_profile("cpu"), api_key="sekret")
        with ThreadedGateway(config) as gw:
            url = f"{gw.url}/v1/chat/completions"
            assert httpx.post(url, json=_chat("hi")).status_code == 401
            auth = {"Authorization": "Bearer sekret"}
            assert httpx.post(url, json=_chat("hi", modalities=["text"]), headers=auth, timeout=30).status_code == 200
            fakes.stages["thinker"].stop()
            health = httpx.get(f"{gw.url}/health", timeout=10)
            assert health.status_code == 503 and health.json()["stages"]["thinker"] != "ok"
            r = httpx.post(url, json=_chat("hi"), headers=auth, timeout=30)
            assert r.status_code == 503
            assert "thinker" in r.json()["error"]["message"]
    finally:
        fakes.stop()


def test_non_streaming_disconnect_cancels_every_stage(gateway: ThreadedGateway, fakes: FakeStages) -> None:
    fakes.thinker.tokens = 200
    fakes.thinker.token_delay_s = 0.05
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat("hi", max_tokens=200), timeout=1.5)
    # generation would run ~10 s more; the disconnect must stop it within a few polls
    assert _wait_idle(fakes, timeout=3.0) == {"thinker": 0, "talker": 0, "code2wav": 0}


def test_ref_audio_reaches_thinker_and_code2wav(gateway: ThreadedGateway, fakes: FakeStages) -> None:
    ref = data_url(wav_bytes(0.75, rate=22050), "audio/wav")
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat("hi", extra_body={"ref_audio": ref}), timeout=30)
    assert r.status_code == 200, r.text
    for stage in ("thinker", "code2wav"):
        pcm = fakes.logs[stage].opens[-1].ref_audio
        assert pcm.sample_rate == 22050 and len(pcm.data) == 2 * int(0.75 * 22050), stage
    bad = httpx.post(f"{gateway.url}/v1/chat/completions",
                     json=_chat("hi", ref_audio=data_url(b"not audio", "audio/wav")), timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "ref_audio"


def test_stage_failure_mid_stream_is_an_sse_error_then_done() -> None:
    fakes = FakeStages()
    try:
        fakes.stages["code2wav"].stop()
        config = GatewayConfig(stage_addrs=fakes.addrs, profile=load_profile("cpu"))
        with ThreadedGateway(config) as gw:
            with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=_chat("hi", stream=True), timeout=30) as r:
                assert r.status_code == 200  # the thinker answered before code2wav was needed
                lines = [line for line in r.iter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            err = json.loads(lines[-2][len("data: "):])["error"]
            assert err["code"] == 503 and "code2wav" in err["message"]
            non_stream = httpx.post(f"{gw.url}/v1/chat/completions", json=_chat("hi"), timeout=30)
            assert non_stream.status_code == 503
            metrics = httpx.get(f"{gw.url}/metrics").text
            assert 'minicpmo_gateway_stage_errors_total{code="stage_unavailable",stage="code2wav"}' in metrics
    finally:
        fakes.stop()


def test_round_robin_over_replicas_and_openai_audio_delta() -> None:
    """Two thinker replicas behind one ip-list address both get work; delta.audio mirrors delta.content."""
    first, second = FakeStages(), FakeStages()
    try:
        addrs = dict(first.addrs)
        addrs["thinker"] = f"{first.addrs['thinker']},{second.addrs['thinker']}"
        config = GatewayConfig(stage_addrs=addrs, profile=load_profile("cpu"), openai_audio_delta=True)
        with ThreadedGateway(config) as gw:
            for _ in range(6):
                r = httpx.post(f"{gw.url}/v1/chat/completions", json=_chat("hi", modalities=["text"]), timeout=30)
                assert r.status_code == 200
            assert len(first.logs["thinker"].opens) >= 1 and len(second.logs["thinker"].opens) >= 1
            assert len(first.logs["thinker"].opens) + len(second.logs["thinker"].opens) == 6
            with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=_chat("hi", stream=True), timeout=30) as r:
                audio = [json.loads(line[6:]) for line in r.iter_lines() if '"modality":"audio"' in line]
            deltas = [c["choices"][0]["delta"] for c in audio if c["choices"][0]["delta"].get("content")]
            assert deltas and all(d["audio"]["data"] == d["content"] for d in deltas)
            assert len({d["audio"]["id"] for d in deltas}) == 1
    finally:
        first.stop()
        second.stop()


def test_audio_only_and_stage_metrics(gateway: ThreadedGateway) -> None:
    r = httpx.post(f"{gateway.url}/v1/chat/completions",
                   json=_chat("hi", modalities=["audio"], audio={"format": "flac"}, return_stage_metrics=True),
                   timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    message = body["choices"][0]["message"]
    assert message["content"] is None
    info = sf.info(io.BytesIO(base64.b64decode(message["audio"]["data"])))
    assert info.format == "FLAC" and info.frames == body["choices"][0]["audio_metadata"]["frame_count"]
    timings = body["metrics"]
    assert 0 < timings["first_speech_chunk"] <= timings["first_audio"] <= timings["total"]


def test_served_model_name_override(fakes: FakeStages) -> None:
    config = GatewayConfig(stage_addrs=fakes.addrs, profile=load_profile("cpu"), served_model_name="minicpmo")
    with ThreadedGateway(config) as gw:
        assert httpx.get(f"{gw.url}/v1/models").json()["data"][0]["id"] == "minicpmo"
        ok = httpx.post(f"{gw.url}/v1/chat/completions", json={**_chat("hi", modalities=["text"]), "model": "minicpmo"},
                        timeout=30)
        assert ok.status_code == 200 and ok.json()["model"] == "minicpmo"
        assert httpx.post(f"{gw.url}/v1/chat/completions", json=_chat("hi"), timeout=30).status_code == 404
