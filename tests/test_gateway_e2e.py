"""End to end: ``minicpmo-serve`` on the tiny checkpoint (three real stage processes + the gateway),
driven with the official ``openai`` SDK and raw HTTP, as a client would.

One launched pipeline is shared by the whole module (start-up dominates the cost). Replies are short
(thinker max 12 tokens, talker max 50 frames = 2 s) to keep the CPU time down.
"""

from __future__ import annotations

import base64
import io
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import soundfile as sf
from launched_pipeline import SHORT_REPLIES, Served, launched
from media_samples import data_url, mp4_bytes, png_bytes, wav_bytes

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

MODEL = "openbmb/MiniCPM-o-4_5"
OVERRIDES = SHORT_REPLIES


@pytest.fixture(scope="module")
def served(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with launched(tiny_ckpt, tmp_path_factory.mktemp("serve"), OVERRIDES) as served:
        stage_ports = served.stage_ports
        yield served
    # Ctrl-C / SIGTERM stops every child: nothing listens on the stage ports any more.
    for port_ in stage_ports.values():
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port_ + 1000}/metrics", timeout=2)


@pytest.fixture(scope="module")
def client(served: Served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", timeout=600, max_retries=0)


def _stage_gauges(served: Served) -> dict[str, float]:
    """In-flight requests and open streams per stage, read from each stage's Prometheus endpoint."""
    out: dict[str, float] = {}
    for stage, port in served.stage_ports.items():
        text = httpx.get(f"http://127.0.0.1:{port + 1000}/metrics", timeout=5).text
        for name in ("minicpmo_stage_in_flight", "minicpmo_stage_streams_active"):
            assert f"# TYPE {name} gauge" in text, f"{stage} does not declare {name}"
            m = re.search(rf'^{name}{{stage="{stage}"}} ([0-9.e+-]+)$', text, re.M)
            # a labelled gauge appears once first set; absent means no stream has touched it yet
            out[f"{stage}.{name.rsplit('_', 2)[-2] + '_' + name.rsplit('_', 1)[-1]}"] = (
                float(m.group(1)) if m else 0.0
            )
    return out


def test_text_only(client) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], modalities=["text"]
    )
    assert len(resp.choices) == 1
    msg = resp.choices[0].message
    assert msg.content and msg.audio is None
    assert resp.usage.completion_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_text_and_audio_non_streaming(client) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        modalities=["text", "audio"],
        audio={"voice": "default", "format": "wav"},
        extra_body={
            "chat_template_kwargs": {"use_tts_template": True, "enable_thinking": False},
            "ref_audio": data_url(wav_bytes(1.0, 16000), "audio/wav"),
            "return_stage_metrics": True,
            "sampling_params_list": [{"max_tokens": 40, "ignore_eos": True}],
        },
    )
    timings = resp.model_extra["metrics"]
    # The talker started on the thinker's first speech chunk (after ~11 of 40 tokens), not at the end of
    # the text: most of the thinker's generation time lies after that point.
    generating = timings["thinker_done"] - timings["first_text"]
    assert timings["thinker_done"] - timings["first_speech_chunk"] > 0.3 * generating, timings
    assert timings["thinker_done"] < timings["audio_done"]
    choice = resp.choices[0]
    # OpenAI's audio dialect (the body carries ``audio``): the words are the transcript, content is null.
    assert choice.message.content is None
    audio = choice.message.audio
    assert re.fullmatch(r"audio_[0-9a-f]{24}", audio.id) and audio.transcript
    assert audio.expires_at > resp.created
    info = sf.info(io.BytesIO(base64.b64decode(audio.data)))
    assert (info.format, info.subtype, info.samplerate, info.channels) == ("WAV", "PCM_16", 24000, 1)
    meta = choice.model_extra["audio_metadata"]
    assert meta == {"format": "wav", "sample_rate_hz": 24000, "frame_count": info.frames, "channels": 1}
    assert info.frames > 0


def test_streaming_order_done_and_single_finish(served: Served) -> None:
    payload = {
        "model": MODEL,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Hi"}],
        "modalities": ["text", "audio"],  # without OpenAI's audio object: the vLLM-Omni dialect (WAV chunks)
    }
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=payload, timeout=600) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    content = [c for c in chunks if c["choices"]]
    assert content[0]["choices"][0]["delta"].get("role") == "assistant"
    finishing = [i for i, c in enumerate(content) if c["choices"][0].get("finish_reason")]
    assert finishing == [len(content) - 1]
    audio = [c for c in content if c["modality"] == "audio" and c["choices"][0]["delta"].get("content")]
    assert audio, "speech was requested"
    frames = 0
    for c in audio:  # every audio chunk is its own decodable WAV whose length matches its metadata
        info = sf.info(io.BytesIO(base64.b64decode(c["choices"][0]["delta"]["content"])))
        assert info.samplerate == 24000 and info.frames == c["choices"][0]["audio_metadata"]["frame_count"]
        frames += info.frames
    first_audio = content.index(audio[0])
    assert all(c["modality"] in ("text", "audio") for c in content)
    assert first_audio > 0
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
    assert frames > 0


def test_image_and_audio_inputs(client) -> None:
    content = [
        {"type": "image_url", "image_url": {"url": data_url(png_bytes(96, 64), "image/png")}},
        {
            "type": "input_audio",
            "input_audio": {"data": base64.b64encode(wav_bytes(1.0)).decode(), "format": "wav"},
        },
        {"type": "text", "text": "What do you see and hear?"},
    ]
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What?"}], modalities=["text"]
    )
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], modalities=["text"]
    )
    assert resp.choices[0].message.content
    # the image (64 slice embeddings + framing) and 1 s of audio (10 embeddings) reached the prompt
    assert resp.usage.prompt_tokens >= plain.usage.prompt_tokens + 64 + 10


def test_video_input(client) -> None:
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What?"}], modalities=["text"]
    )
    content = [
        {"type": "video_url", "video_url": {"url": data_url(mp4_bytes(3.0), "video/mp4")}},
        {"type": "text", "text": "What happens?"},
    ]
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], modalities=["text"]
    )
    assert resp.choices[0].message.content
    # three frames at the profile's 1 fps (64 embeddings each) and a 3 s soundtrack (~30 embeddings)
    assert resp.usage.prompt_tokens >= plain.usage.prompt_tokens + 3 * 64 + 25


def _wait_idle(served: Served, timeout_s: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    gauges = _stage_gauges(served)
    while any(gauges.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
        gauges = _stage_gauges(served)
    return gauges


def test_client_disconnect_releases_all_stage_work(served: Served) -> None:
    idle = _wait_idle(served)
    assert not any(idle.values()), f"work left over from completed requests: {idle}"
    # Long enough that finishing naturally takes minutes on the CPU: only cancellation frees the stages
    # within the (generous) wait below.
    payload = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 3000,
        "sampling_params_list": [{"max_tokens": 3000, "ignore_eos": True}, {"max_tokens": 2000}],
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "modalities": ["text", "audio"],
    }
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=payload, timeout=600) as r:
        assert r.status_code == 200
        # Keep the line iterator referenced: a dropped httpx iterator is closed at once, which closes the
        # connection, and the stages would be measured after the disconnect instead of before it.
        lines = r.iter_lines()
        for line in lines:
            if '"modality":"audio"' in line:
                break
        busy = _stage_gauges(served)
        assert any(busy.values()), busy
    gauges = _wait_idle(served, timeout_s=30.0)
    assert not any(gauges.values()), f"work left after the client disconnected: {gauges}"


@pytest.mark.parametrize(
    "body, status",
    [
        (b'{"model": "openbmb/MiniCPM-o-4_5", "messages": [', 400),
        ({"model": MODEL, "messages": [{"role": "user", "content": 42}]}, 400),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400),
        ({"model": "not-this-model", "messages": [{"role": "user", "content": "hi"}]}, 404),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "audio": {"format": "aac"}}, 400),
        (
            {
                "model": MODEL,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": {"url": data_url(png_bytes()[:40], "image/png")},
                            }
                        ],
                    }
                ],
            },
            400,
        ),
        (
            {
                "model": MODEL,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "input_audio",
                                "input_audio": {"data": base64.b64encode(b"RIFF\x00garbage").decode()},
                            }
                        ],
                    }
                ],
            },
            400,
        ),
        (b'{"model": "openbmb/MiniCPM-o-4_5", "pad": "' + b"x" * (33 * 1024 * 1024) + b'"}', 413),
    ],
)
def test_bad_inputs(served: Served, body, status: int) -> None:
    url = f"{served.url}/v1/chat/completions"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    else:
        r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["code"], str) and err["code"], err  # the reason to fix, not the status
    health = httpx.get(f"{served.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "healthy"


def test_models_and_metrics(served: Served) -> None:
    models = httpx.get(f"{served.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    metrics = httpx.get(f"{served.url}/metrics").text
    assert re.search(
        r'minicpmo_gateway_requests_total\{route="/v1/chat/completions",status="200"\} [1-9]', metrics
    )
    assert re.search(r"minicpmo_gateway_time_to_first_audio_seconds_count [1-9]", metrics)
