"""The gateway's own promises against REAL stage processes and REAL failures (tiny checkpoint, CPU).

``test_gateway_e2e.py`` drives the launcher's pipeline as a client would (shape, media, disconnect).
This module covers what needs a particular topology or a broken stage: a replica list with a dead
address, two code2wav replicas behind one address, a stage nobody listens on, a code2wav process
SIGKILLed mid-stream, stage-side validation errors, the concurrency limit, non-streaming disconnect,
API key / served name / OpenAI-style audio deltas, and ``stream_options.continuous_usage_stats``.

One set of five stage processes (thinker, talker, three code2wav) serves the module; each test builds
the in-process gateway it needs over them (cheap). Which replica did the work is read from that
replica's own Prometheus endpoint.
"""

from __future__ import annotations

import base64
import io
import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from gateway_server import ThreadedGateway
from media_samples import data_url, wav_bytes
from stage_processes import StageProcess, dead_address, start_stages, stop_all

from gateway.config import GatewayConfig
from services.common.deploy_profile import load_profile

pytestmark = pytest.mark.slow

MODEL = "openbmb/MiniCPM-o-4_5"
THINKER_MAX_CONTEXT = 512
THINKER_MAX_TOKENS = 12  # the profile default every request gets unless it says otherwise
# A deployment whose clients expect speech without asking: no ``modalities`` means text + audio here
# (the profile's gateway.default_modalities; OpenAI's text-only default is tests/test_gateway_dropin.py's).
PROFILE_OVERRIDES = {
    "thinker": {"sampling": {"max_tokens": THINKER_MAX_TOKENS}},
    "talker": {"sampling": {"max_new_frames": 50}},
    "gateway": {"default_modalities": ["text", "audio"]},
}
# Long enough that finishing naturally takes far longer than the waits below: only cancellation
# frees the stages in time.
LONG_SPEECH = {
    "max_tokens": 400,
    "sampling_params_list": [{"max_tokens": 400, "ignore_eos": True}, {"max_tokens": 2000}],
}


CLIENT_PATIENCE_S = 8.0  # the non-streaming client gives up after this (the talker starts within ~1 s)


@dataclass
class Stages:
    thinker: StageProcess
    talker: StageProcess
    code2wav: StageProcess  # replica A of the main gateway's code2wav list
    code2wav_b: StageProcess  # replica B of that list
    code2wav_victim: StageProcess  # SIGKILLed by the mid-stream failure test, used by nothing else

    def all(self) -> list[StageProcess]:
        return [self.thinker, self.talker, self.code2wav, self.code2wav_b, self.code2wav_victim]

    def addrs(self, **replace: str) -> dict[str, str]:
        addrs = {
            "thinker": self.thinker.addr,
            "talker": self.talker.addr,
            "code2wav": f"{self.code2wav.addr},{self.code2wav_b.addr}",
        }
        return {**addrs, **replace}


@pytest.fixture(scope="module")
def stages(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stages]:
    procs = start_stages(
        tiny_ckpt,
        tmp_path_factory.mktemp("stage_logs"),
        [
            ("thinker", ["--max-context", str(THINKER_MAX_CONTEXT)]),
            ("talker", []),
            ("code2wav", []),
            ("code2wav", []),
            ("code2wav", []),
        ],
    )
    try:
        yield Stages(*procs)
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def media_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "tone.wav").write_bytes(wav_bytes(1.0))
    return root


def _config(addrs: dict[str, str], **kw) -> GatewayConfig:
    return GatewayConfig(
        stage_addrs=addrs, profile=load_profile("cpu").with_overrides(PROFILE_OVERRIDES), **kw
    )


@pytest.fixture(scope="module")
def gateway(stages: Stages, media_root: Path) -> Iterator[ThreadedGateway]:
    """The main gateway: every stage real, code2wav as a two-replica list, two concurrent requests."""
    with ThreadedGateway(
        _config(stages.addrs(), allowed_media_root=media_root, max_concurrent_requests=2)
    ) as gw:
        yield gw


def _chat(content, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def _sse_lines(url: str, payload: dict, timeout: float = 300) -> list[str]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=payload, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line]


def _chunks(lines: list[str]) -> list[dict]:
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def _gateway_counter(url: str, name: str, **labels: str) -> float:
    """A labelled counter from the gateway's /metrics (the registry is per process: compare deltas)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    series = f"{name}{{{want}}}" if want else name
    m = re.search(rf"^{re.escape(series)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _busy(procs: list[StageProcess]) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in procs:
        if p.proc.poll() is None:
            out.update({f"{k}@{p.port}": v for k, v in p.busy().items()})
    return out


def _wait_idle(procs: list[StageProcess], timeout_s: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    busy = _busy(procs)
    while any(busy.values()) and time.monotonic() < deadline:
        time.sleep(0.25)
        busy = _busy(procs)
    return busy


# ---- what goes to which stage ---------------------------------------------------------------------
def test_text_only_never_opens_speech_stages(gateway: ThreadedGateway, stages: Stages) -> None:
    speech = [stages.talker, stages.code2wav, stages.code2wav_b]
    before = [p.streams_opened() for p in speech]
    thinker_before = stages.thinker.streams_opened()
    payload = _chat("hi", modalities=["text"], sampling_params_list=[{"ignore_eos": True}])
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=payload, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    message = body["choices"][0]["message"]
    assert isinstance(message["content"], str) and "audio" not in message
    # the cpu profile's default max_tokens reached the thinker: with EOS ignored it ran to exactly that
    assert body["choices"][0]["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == THINKER_MAX_TOKENS
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert stages.thinker.streams_opened() == thinker_before + 1
    assert [p.streams_opened() for p in speech] == before


def test_round_robin_over_code2wav_replicas(gateway: ThreadedGateway, stages: Stages) -> None:
    """Two consecutive speech requests land on the two replicas of one comma-listed address."""
    replicas = [stages.code2wav, stages.code2wav_b]
    before = [p.streams_opened() for p in replicas]
    for _ in range(2):
        r = httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat("hi"), timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["audio"]["data"]
    assert [p.streams_opened() - b for p, b in zip(replicas, before, strict=True)] == [1, 1]


def test_audio_only_flac_and_stage_metrics(gateway: ThreadedGateway) -> None:
    payload = _chat("hi", modalities=["audio"], audio={"format": "flac"}, return_stage_metrics=True)
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=payload, timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    message = body["choices"][0]["message"]
    assert message["content"] is None and message["audio"]["transcript"]  # the words spoken
    info = sf.info(io.BytesIO(base64.b64decode(message["audio"]["data"])))
    assert (info.format, info.samplerate) == ("FLAC", 24000)
    assert info.frames == body["choices"][0]["audio_metadata"]["frame_count"] > 0
    timings = body["metrics"]
    assert 0 < timings["first_speech_chunk"] <= timings["first_audio"] <= timings["total"]


def test_file_url_media_and_sdk_stream(gateway: ThreadedGateway, media_root: Path) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", timeout=300, max_retries=0)
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What?"}], modalities=["text"]
    )
    content = [
        {"type": "audio_url", "audio_url": {"url": "file://" + str(media_root / "tone.wav")}},
        {"type": "text", "text": "What?"},
    ]
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], modalities=["text"]
    )
    # 1 s of audio read from the allowed root became ~10 audio embeddings in the thinker's prompt
    assert resp.usage.prompt_tokens >= plain.usage.prompt_tokens + 10
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], modalities=["text"], stream=True
    )
    finish = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1


# ---- stream_options.continuous_usage_stats -------------------------------------------------------
def test_continuous_usage_stats_on_every_chunk(gateway: ThreadedGateway) -> None:
    # OpenAI's audio dialect (the body carries ``audio``): words in delta.audio.transcript, speech in
    # delta.audio.data as 24 kHz PCM16.
    payload = _chat(
        "hi",
        stream=True,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "pcm16"},
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    chunks = _chunks(_sse_lines(gateway.url, payload))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert not any(c["choices"] and c["choices"][0]["delta"].get("content") for c in chunks)
    assert all("usage" in c for c in chunks), "continuous_usage_stats: every chunk carries usage"
    usages = [c["usage"] for c in chunks]
    prompt = usages[0]["prompt_tokens"]
    assert prompt > 0 and all(u["prompt_tokens"] == prompt for u in usages)  # known from the first chunk
    completions = [u["completion_tokens"] for u in usages]
    assert completions[0] == 0 and completions == sorted(completions)
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    # each text delta already counts its own tokens: one more chunk, at least one more token
    text_counts = [
        c["usage"]["completion_tokens"]
        for c in chunks
        if c["choices"] and c["choices"][0]["delta"].get("audio", {}).get("transcript")
    ]
    assert text_counts and text_counts[0] >= 1 and len(set(text_counts)) == len(text_counts)
    # the finishing chunk and the include_usage chunk both carry the thinker's final count
    final = chunks[-1]["usage"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert chunks[-1]["choices"] == [] and all(final[k] == chunks[-2]["usage"][k] for k in counts)
    # the final usage is OpenAI's full object: both details always present (cached: the prefix cache's)
    cached = chunks[-2]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert final["prompt_tokens_details"]["cached_tokens"] == cached <= final["prompt_tokens"]
    assert final["completion_tokens_details"]["reasoning_tokens"] == 0
    assert chunks[-2]["choices"][0]["finish_reason"]
    assert chunks[-1]["usage"]["completion_tokens"] >= text_counts[-1]
    # audio chunks: raw 16-bit samples, one audio id for the whole response
    audio = [
        c["choices"][0]["delta"].get("audio") for c in chunks if c["choices"] and c["modality"] == "audio"
    ]
    audio = [a for a in audio if a and a.get("data")]
    assert audio and all(len(base64.b64decode(a["data"])) % 2 == 0 for a in audio)
    assert len({a["id"] for a in audio}) == 1


def test_usage_only_at_the_end_without_continuous_stats(gateway: ThreadedGateway) -> None:
    payload = _chat("hi", stream=True, modalities=["text"], stream_options={"include_usage": True})
    chunks = _chunks(_sse_lines(gateway.url, payload))
    assert [c for c in chunks if "usage" in c] == [chunks[-1]] and chunks[-1]["choices"] == []


# ---- stage-side validation ------------------------------------------------------------------------
def test_thinker_rejection_maps_to_400_with_param(gateway: ThreadedGateway) -> None:
    # a logit_bias id passes the gateway's check (a decimal id); only the thinker knows its vocabulary
    bias = {"logit_bias": {"99999999": 5}}
    for stream in (False, True):
        r = httpx.post(
            f"{gateway.url}/v1/chat/completions", json=_chat("hi", stream=stream, **bias), timeout=120
        )
        assert r.status_code == 400, r.text  # streaming too: nothing had been sent yet
        err = r.json()["error"]
        # the thinker's typed reason is the envelope's code, never the HTTP status
        assert err["code"] == "invalid_argument" and err["type"] == "invalid_request_error"
        assert err["param"] == "logit_bias.99999999" and "thinker" in err["message"]


def test_prompt_over_the_context_is_context_length_exceeded(gateway: ThreadedGateway, stages: Stages) -> None:
    """A prompt 4x the thinker's context: 400 code context_length_exceeded, param messages, before any
    token is generated (streaming too: the refusal comes before the 200), and the stages stay idle."""
    prompt = "hello " * (4 * THINKER_MAX_CONTEXT)
    for stream in (False, True):
        started = time.monotonic()
        r = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            json=_chat(prompt, modalities=["text"], stream=stream),
            timeout=120,
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "messages", err
        assert err["type"] == "invalid_request_error" and str(THINKER_MAX_CONTEXT) in err["message"]
        assert time.monotonic() - started < 30
    assert not any(_wait_idle(stages.all(), 30).values())


def test_silent_ref_audio_reaches_thinker_and_is_refused_by_code2wav(gateway: ThreadedGateway) -> None:
    """The gateway decodes it fine; the thinker takes it into its prompt; code2wav refuses a silent voice."""
    silent = io.BytesIO()
    sf.write(silent, np.zeros(32000, dtype=np.float32), 16000, format="WAV", subtype="PCM_16")
    ref = data_url(silent.getvalue(), "audio/wav")
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions", json=_chat("hi", extra_body={"ref_audio": ref}), timeout=300
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "open.ref_audio" and "code2wav" in err["message"] and "silent" in err["message"]
    # streaming: text was already out, so the refusal is an SSE error event, then [DONE]; the running
    # usage shows the reference voice made the thinker's prompt longer
    opts = {"include_usage": True, "continuous_usage_stats": True}
    plain = _chunks(
        _sse_lines(gateway.url, _chat("hi", stream=True, modalities=["text"], stream_options=opts))
    )
    lines = _sse_lines(gateway.url, _chat("hi", stream=True, ref_audio=ref, stream_options=opts))
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "bad_reference_audio" and error["param"] == "open.ref_audio"
    with_ref = [json.loads(line.removeprefix("data: ")) for line in lines[:-2]]
    assert with_ref[0]["usage"]["prompt_tokens"] > plain[0]["usage"]["prompt_tokens"]


# ---- limits and cancellation ----------------------------------------------------------------------
def test_concurrency_limit_429_then_slots_and_stages_free(gateway: ThreadedGateway, stages: Stages) -> None:
    assert not any(_wait_idle(stages.all(), 30).values())
    client = httpx.Client(timeout=300)
    streams = []
    try:
        for _ in range(2):
            s = client.stream(
                "POST", f"{gateway.url}/v1/chat/completions", json=_chat("hi", stream=True, **LONG_SPEECH)
            )
            resp = s.__enter__()
            streams.append(s)
            assert resp.status_code == 200
        r = httpx.post(
            f"{gateway.url}/v1/chat/completions", json=_chat("hi", modalities=["text"]), timeout=60
        )
        assert r.status_code == 429 and r.json()["error"]["code"] == 429
        assert r.headers["retry-after"] == "1"  # the OpenAI SDKs wait that long before their retry
        assert stages.thinker.metric("minicpmo_stage_streams_active") == 2
    finally:
        for s in streams:
            s.__exit__(None, None, None)
        client.close()
    busy = _wait_idle(stages.all(), 15)
    assert not any(busy.values()), f"stage work left after both clients went away: {busy}"
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat("hi", modalities=["text"]), timeout=120)
    assert r.status_code == 200, "both slots came back"


def test_non_streaming_disconnect_cancels_every_stage(gateway: ThreadedGateway, stages: Stages) -> None:
    assert not any(_wait_idle(stages.all(), 30).values())
    disconnects = _gateway_counter(gateway.url, "minicpmo_gateway_client_disconnects_total")
    outcome: list[BaseException] = []

    def post() -> None:
        try:
            httpx.post(
                f"{gateway.url}/v1/chat/completions",
                json=_chat("hi", **LONG_SPEECH),
                timeout=CLIENT_PATIENCE_S,
            )
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            outcome.append(exc)

    worker = threading.Thread(target=post)
    worker.start()
    deadline = time.monotonic() + CLIENT_PATIENCE_S
    saw_speech = False
    while worker.is_alive() and time.monotonic() < deadline and not saw_speech:
        saw_speech = stages.talker.metric("minicpmo_stage_streams_active") > 0
        time.sleep(0.1)
    worker.join(30)
    assert saw_speech, "the talker should have been working when the client gave up"
    assert outcome and isinstance(outcome[0], httpx.ReadTimeout)
    busy = _wait_idle(stages.all(), 10)
    assert not any(busy.values()), f"stage work left after the client went away: {busy}"
    assert _gateway_counter(gateway.url, "minicpmo_gateway_client_disconnects_total") == disconnects + 1


# ---- dead addresses ---------------------------------------------------------------------------
def test_stage_down_is_503_with_retry_hint_before_any_stream(stages: Stages) -> None:
    dead = dead_address()
    with ThreadedGateway(_config(stages.addrs(thinker=dead))) as gw:
        health = httpx.get(f"{gw.url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        report = health.json()["stages"]
        assert report["thinker"] != "ok" and report["talker"] == "ok" and report["code2wav"] == "ok"
        assert _gateway_counter(gw.url, "minicpmo_gateway_stage_up", stage="thinker") == 0
        assert _gateway_counter(gw.url, "minicpmo_gateway_stage_up", stage="talker") == 1
        retries = _gateway_counter(gw.url, "minicpmo_gateway_stage_retries_total", stage="thinker")
        errors = _gateway_counter(
            gw.url, "minicpmo_gateway_stage_errors_total", code="stage_unavailable", stage="thinker"
        )
        for stream in (False, True):
            r = httpx.post(f"{gw.url}/v1/chat/completions", json=_chat("hi", stream=stream), timeout=60)
            assert r.status_code == 503, r.text  # streaming too: refused before any 200
            assert int(r.headers["retry-after"]) >= 1
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == 503
            assert "thinker" in err["message"] and dead in err["message"]
        # the health monitor already knew: no stage stream was opened (so none was retried)
        assert _gateway_counter(gw.url, "minicpmo_gateway_stage_retries_total", stage="thinker") == retries
        assert (
            _gateway_counter(
                gw.url, "minicpmo_gateway_stage_errors_total", code="stage_unavailable", stage="thinker"
            )
            == errors + 2
        )


def test_dead_replica_in_list_is_skipped(stages: Stages) -> None:
    """A replica list with one dead address: every request still succeeds, all on the live replica."""
    with ThreadedGateway(_config(stages.addrs(thinker=f"{dead_address()},{stages.thinker.addr}"))) as gw:
        before = stages.thinker.streams_opened()
        for _ in range(3):
            r = httpx.post(
                f"{gw.url}/v1/chat/completions", json=_chat("hi", modalities=["text"]), timeout=120
            )
            assert r.status_code == 200, r.text
        assert stages.thinker.streams_opened() == before + 3


# ---- gateway options -------------------------------------------------------------------------
def test_api_key_served_name_and_openai_audio_dialect(stages: Stages) -> None:
    config = _config(stages.addrs(), api_key="sekret", served_model_name="minicpmo")
    with ThreadedGateway(config) as gw:
        url = f"{gw.url}/v1/chat/completions"
        auth = {"Authorization": "Bearer sekret"}
        body = {
            **_chat(
                "hi", stream=True, modalities=["text", "audio"], audio={"voice": "nova", "format": "pcm16"}
            ),
            "model": "minicpmo",
        }
        assert httpx.post(url, json=body, timeout=30).status_code == 401
        assert (
            httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}, timeout=30).status_code
            == 401
        )
        assert httpx.get(f"{gw.url}/health", timeout=10).status_code == 200  # open without a key
        models = httpx.get(f"{gw.url}/v1/models", headers=auth, timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["minicpmo"]
        assert (
            httpx.post(url, json=_chat("hi"), headers=auth, timeout=30).status_code == 404
        )  # the default name
        with httpx.stream("POST", url, json=body, headers=auth, timeout=300) as r:
            assert r.status_code == 200
            chunks = _chunks([line for line in r.iter_lines() if line])
        assert {c["model"] for c in chunks} == {"minicpmo"}
        deltas = [
            c["choices"][0]["delta"]
            for c in chunks
            if c["choices"] and c["choices"][0]["delta"].get("audio", {}).get("data")
        ]
        assert deltas and all("content" not in d for d in deltas)
        assert len({d["audio"]["id"] for d in deltas}) == 1


@pytest.mark.parametrize(
    "payload, status, param",
    [
        (_chat("hi", modalities="text"), 400, "modalities"),
        (_chat("hi", modalities=["video"]), 400, "modalities"),
        (_chat("hi", temperature="hot"), 400, "temperature"),
        (_chat("hi", ref_audio=5), 400, "ref_audio"),
        (_chat("hi", ref_audio=data_url(b"not audio", "audio/wav")), 400, "ref_audio"),
        ({"model": MODEL, "messages": "hi"}, 400, "messages"),
        (
            _chat([{"type": "video_url", "video_url": {"url": data_url(b"\x00" * 64, "video/mp4")}}]),
            400,
            "messages[0].content[0]",
        ),
        (
            _chat([{"type": "input_audio", "input_audio": {"data": "%%%not-base64"}}]),
            400,
            "messages[0].content[0].input_audio.data",
        ),
        (
            _chat([{"type": "audio_url", "audio_url": {"url": "file:///etc/passwd"}}]),
            403,
            "messages[0].content[0].audio_url.url",
        ),
        (
            _chat([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]),
            403,
            "messages[0].content[0].image_url.url",
        ),
        (_chat("hi", sampling_params_list=[{"temprature": 1}]), 400, "sampling_params_list[0].temprature"),
    ],
)
def test_bad_inputs_get_the_envelope(
    gateway: ThreadedGateway, stages: Stages, payload, status: int, param
) -> None:
    """Refused in the gateway before any stage is asked: no stream opens anywhere."""
    before = stages.thinker.streams_opened()
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=payload, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert isinstance(err["code"], str) and err["code"] and err["type"] == "invalid_request_error", err
    assert err["param"] == param
    assert stages.thinker.streams_opened() == before


def test_health_and_metric_names(gateway: ThreadedGateway, stages: Stages) -> None:
    health = httpx.get(f"{gateway.url}/health", timeout=10)
    assert health.status_code == 200
    assert health.json() == {
        "status": "healthy",
        "stages": {"thinker": "ok", "talker": "ok", "code2wav": "ok"},
        "replicas": {
            "thinker": {stages.thinker.addr: "ok"},
            "talker": {stages.talker.addr: "ok"},
            "code2wav": {stages.code2wav.addr: "ok", stages.code2wav_b.addr: "ok"},
        },
    }
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    for name in (
        "minicpmo_gateway_time_to_first_token_seconds_bucket",
        "minicpmo_gateway_real_time_factor_bucket",
        "minicpmo_gateway_stage_errors_total",
        "minicpmo_gateway_stage_retries_total",
        "minicpmo_gateway_client_disconnects_total",
        "minicpmo_gateway_audio_seconds_total",
    ):
        assert name in text


# ---- a stage dies mid-stream (last: it kills a process) ------------------------------------------
def test_code2wav_killed_mid_stream(stages: Stages) -> None:
    victim = stages.code2wav_victim
    with ThreadedGateway(_config(stages.addrs(code2wav=victim.addr))) as gw:
        payload = _chat("hi", stream=True, **LONG_SPEECH)
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=payload, timeout=300) as r:
            assert r.status_code == 200
            lines = []
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if victim.proc.poll() is None and '"modality":"text"' in line and '"content":""' not in line:
                    victim.kill()  # after the first real text delta
            assert victim.proc.poll() is not None, "the stream ended before any text delta"
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert err["code"] == 503 and "code2wav" in err["message"]
        # asked right after the client saw the failure, /health agrees (the failed stream re-probed the
        # replica; the periodic probe alone could still hold the "ok" from before the kill)
        health = httpx.get(f"{gw.url}/health", timeout=10)
        assert health.status_code == 503, health.json()
        report = health.json()["stages"]
        assert report["code2wav"] != "ok" and report["thinker"] == "ok" and report["talker"] == "ok"
        # the other stages were released, and the gateway keeps serving what does not need code2wav
        busy = _wait_idle([stages.thinker, stages.talker], 10)
        assert not any(busy.values()), busy
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=_chat("hi", modalities=["text"]), timeout=120)
        assert r.status_code == 200, r.text
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=_chat("hi"), timeout=120)
        assert r.status_code == 503 and "code2wav" in r.json()["error"]["message"]
