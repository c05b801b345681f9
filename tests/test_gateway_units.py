"""Fast unit tests of the gateway's pure logic: request validation, audio encoding, media sources, targets."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import grpc
import numpy as np
import pytest
import soundfile as sf
from media_samples import data_url, png_bytes, wav_bytes

from gateway.audio_encoding import SUPPORTED_FORMATS, encode_audio, normalize_format
from gateway.media import MediaError, MediaPolicy, check_image, decode_audio, load_url
from gateway.openai.errors import APIError
from gateway.openai.protocol import parse_chat_request
from gateway.stage_clients import normalize_target, replica_targets
from gateway.stage_failure import StageFailure
from services.common.deploy_profile import MediaLimits

MODEL = "openbmb/MiniCPM-o-4_5"


def _req(**extra):
    return parse_chat_request(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}, MODEL
    )


def test_defaults_follow_wire_protocol() -> None:
    assert _req().modalities == ["text"]  # the parse default; the route passes the served default
    req = parse_chat_request(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, MODEL, None, ("text", "audio")
    )
    assert req.modalities == ["text", "audio"] and req.audio_format == "wav"
    assert req.use_tts_template is True and req.enable_thinking is False
    assert not req.stream and not req.include_usage
    text_only = _req(modalities=["text"])
    assert text_only.use_tts_template is False and not text_only.want_audio


def test_sampling_precedence_and_aliases() -> None:
    req = _req(
        max_tokens=50,
        temperature=0.5,
        top_k=-1,
        sampling_params_list=[
            {"temperature": 0.1, "stop_token_ids": [1, 2], "detokenize": False},
            {"max_tokens": 300, "min_tokens": 10, "top_k": 20},
        ],
    )
    assert req.thinker_sampling == {
        "max_tokens": 50,
        "temperature": 0.1,
        "top_k": 0,
        "stop_token_ids": [1, 2],
    }
    assert req.talker_sampling == {"max_new_frames": 300, "min_new_frames": 10, "top_k": 20}
    assert _req(max_completion_tokens=9).thinker_sampling["max_tokens"] == 9
    assert _req(max_completion_tokens=9, max_tokens=9).thinker_sampling["max_tokens"] == 9
    with pytest.raises(APIError) as info:
        _req(max_completion_tokens=9, max_tokens=50)
    assert info.value.param == "max_completion_tokens"


def test_pcm16_is_normalised() -> None:
    assert _req(audio={"format": "pcm16"}).audio_format == "pcm"
    assert (
        normalize_format("WAV") == "wav" and normalize_format("aac") is None and normalize_format(3) is None
    )


def test_ref_audio_from_extra_body() -> None:
    assert _req(extra_body={"ref_audio": "data:audio/wav;base64,AAAA"}).ref_audio.startswith("data:")


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"messages": [{"role": "user", "content": "hi"}], "model": 3}, 400, "model"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
        ({"messages": [{"role": "system", "content": "only a system prompt"}]}, 400, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "file"}]}]}, 400, "messages[0].content[0].type"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            400,
            "messages[0].content[0].image_url.url",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "content": [{"type": "image_url", "image_url": "data:x"}]},
                    {"role": "user", "content": "hi"},
                ]
            },
            400,
            "messages[0].content[0]",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": "no"}, 400, "logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, 400, "top_p"),
        ({"messages": [{"role": "user", "content": "hi"}], "modalities": []}, 400, "modalities"),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "chat_template_kwargs": {"use_tts_template": 1},
            },
            400,
            "chat_template_kwargs.use_tts_template",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "sampling_params_list": {"temperature": 1}},
            400,
            "sampling_params_list",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
            400,
            "tools[0].function",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
            400,
            "response_format.type",
        ),
    ],
)
def test_invalid_requests(body: dict, status: int, param: str) -> None:
    with pytest.raises(APIError) as info:
        parse_chat_request(body, MODEL)
    assert info.value.status == status and info.value.param == param


def test_unknown_model_is_404() -> None:
    with pytest.raises(APIError) as info:
        parse_chat_request({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, MODEL)
    assert info.value.status == 404


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
def test_every_format_decodes_back(fmt: str) -> None:
    t = np.arange(24000) / 24000.0
    x = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    data = encode_audio(x, 24000, fmt)
    if fmt == "pcm":
        y = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768
        assert y.size == x.size
        return
    y, rate = sf.read(io.BytesIO(data), dtype="float32")
    assert rate == 24000
    if fmt in ("wav", "flac"):  # lossless at 16 bit
        assert y.size == x.size and np.abs(y - x).max() < 1e-3
    else:  # lossy codecs keep the duration within a frame or two of padding
        assert abs(y.size - x.size) < 4000


def test_load_url_sources(tmp_path: Path) -> None:
    policy = MediaPolicy(limits=MediaLimits(max_media_bytes=1000), allowed_root=tmp_path)
    run = asyncio.run
    assert run(load_url("data:text/plain,hello%20there", policy, "p")) == b"hello there"
    (tmp_path / "a.bin").write_bytes(b"abc")
    assert run(load_url(f"file://{tmp_path}/a.bin", policy, "p")) == b"abc"
    (tmp_path / "big.bin").write_bytes(b"x" * 2000)
    cases = [
        (f"file://{tmp_path}/../outside.bin", 403),
        (f"file://{tmp_path}/big.bin", 413),
        (f"file://{tmp_path}/missing.bin", 400),
        ("http://example.com/x", 403),
        ("ftp://example.com/x", 400),
        ("data:audio/wav;base64,@@@", 400),
        ("data:nocomma", 400),
    ]
    for url, status in cases:
        with pytest.raises(MediaError) as info:
            run(load_url(url, policy, "p"))
        assert info.value.status == status, url
    no_root = MediaPolicy(limits=MediaLimits())
    with pytest.raises(MediaError) as info:
        run(load_url(f"file://{tmp_path}/a.bin", no_root, "p"))
    assert info.value.status == 403


def test_image_and_audio_limits() -> None:
    with pytest.raises(MediaError) as info:
        check_image(png_bytes(100, 100), MediaLimits(max_image_pixels=5000), "img")
    assert info.value.status == 413
    with pytest.raises(MediaError) as info:
        check_image(png_bytes()[:60], MediaLimits(), "img")
    assert info.value.status == 400
    with pytest.raises(MediaError) as info:
        decode_audio(wav_bytes(2.0), MediaLimits(max_audio_seconds=1.0), "aud")
    assert info.value.status == 413
    audio = decode_audio(wav_bytes(0.5, rate=22050), MediaLimits(), "aud")
    assert audio.sample_rate == 22050 and audio.samples.size == 11025
    assert data_url(b"x", "a/b") == "data:a/b;base64,eA=="


def test_normalize_target() -> None:
    assert normalize_target("localhost:50051") == "dns:///localhost:50051"
    assert normalize_target("dns:///thinker.ns.svc:50051") == "dns:///thinker.ns.svc:50051"
    assert normalize_target("127.0.0.1:1,127.0.0.1:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"
    with pytest.raises(ValueError):
        normalize_target("a:1,b:2")


def test_replica_targets_split_fixed_lists_only() -> None:
    """Each address of a fixed list is a replica of its own (probed and picked apart); a DNS name is one
    entry whose records gRPC's resolver balances."""
    assert replica_targets("127.0.0.1:1, 127.0.0.1:2") == [
        ("127.0.0.1:1", "ipv4:127.0.0.1:1"),
        ("127.0.0.1:2", "ipv4:127.0.0.1:2"),
    ]
    assert replica_targets("ipv6:[::1]:5,[::1]:6") == [
        ("[::1]:5", "ipv6:[::1]:5"),
        ("[::1]:6", "ipv6:[::1]:6"),
    ]
    assert replica_targets("code2wav:50053") == [("code2wav:50053", "dns:///code2wav:50053")]
    assert replica_targets("127.0.0.1:9") == [("127.0.0.1:9", "dns:///127.0.0.1:9")]


def test_realtime_session_limit_from_profile_and_flag() -> None:
    """The duplex session cap reaches the realtime endpoint: profile value, overridden by the CLI flag."""
    from gateway.app import build_parser, config_from_args, create_app

    base = ["--deploy-config", "minicpmo_4_5"]
    app = create_app(config_from_args(build_parser().parse_args(base)))
    assert app.state.realtime_settings.max_sessions == 16  # the 1-GPU profile admits 16 duplex sessions
    app = create_app(config_from_args(build_parser().parse_args([*base, "--max-realtime-sessions", "3"])))
    assert app.state.realtime_settings.max_sessions == 3
    app = create_app(config_from_args(build_parser().parse_args(["--deploy-config", "cpu"])))
    assert app.state.realtime_settings.max_sessions == 4


def test_audio_duration_refused_from_the_header_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    import gateway.media as media

    def no_decode(*_: object) -> None:
        raise AssertionError("decoded although the header already says it is too long")

    monkeypatch.setattr(media, "read_audio", no_decode)
    with pytest.raises(MediaError) as info:
        decode_audio(wav_bytes(seconds=3.0), MediaLimits(max_audio_seconds=2.0), "messages[0].content[0]")
    assert info.value.status == 413 and info.value.code == "audio_too_long"
    assert info.value.param == "messages[0].content[0]" and "2 s" in info.value.message


def test_media_pool_is_bounded() -> None:
    import threading

    from gateway.media_pool import MediaPool

    pool = MediaPool(workers=1, max_pending=2)
    release = threading.Event()

    async def main() -> None:
        busy = [asyncio.create_task(pool.run(release.wait, 5, param=f"p{i}")) for i in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(MediaError) as info:
            await pool.run(int, "1", param="messages[0].content[2]")
        assert info.value.status == 503 and info.value.code == "media_queue_full"
        assert info.value.headers == {"Retry-After": "1"} and info.value.param == "messages[0].content[2]"
        release.set()
        assert await asyncio.gather(*busy) == [True, True]
        assert await pool.run(int, "7", param="x") == 7 and pool.pending == 0

    asyncio.run(main())


def test_stage_backpressure_answers_retry_after() -> None:
    """A stage's RESOURCE_EXHAUSTED (typed or as a gRPC status) is a 429 that says when to retry, like the
    gateway's own concurrency limit and a stage that is down (503); other failures carry no such hint."""
    from services.common.pb import common_pb2

    typed = StageFailure.from_stage_error(
        "thinker",
        common_pb2.Error(code=common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED, message="KV pool full"),
    )
    assert typed.status == 429 and typed.retry_after_s == 1
    bad = StageFailure.from_stage_error(
        "thinker", common_pb2.Error(code=common_pb2.ERROR_CODE_INVALID_ARGUMENT, message="bad")
    )
    assert bad.status == 400 and bad.retry_after_s is None

    class _Rpc(grpc.aio.AioRpcError):
        def __init__(self, code: grpc.StatusCode) -> None:
            super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="busy")

    for code, status, retry in (
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, 1),
        (grpc.StatusCode.UNAVAILABLE, 503, 1),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, None),
    ):
        failure = StageFailure.from_rpc_error("talker", "127.0.0.1:1", _Rpc(code))
        assert (failure.status, failure.retry_after_s) == (status, retry)
