"""Gateway audio helpers without stages: segmenting, windowing, silence trimming, the registry's files,
streaming encoders, the time stretch and realtime voice resolution."""

from __future__ import annotations

import io
from pathlib import Path

import av
import numpy as np
import pytest

from gateway.audio.encoding import SPEECH_FORMATS, StreamEncoder, wav_stream_header
from gateway.audio.speed import TimeStretch, atempo_chain
from gateway.audio.text import split_segments, split_sentences
from gateway.audio.transcribe import (
    WINDOW_MAX_TOKENS,
    render_srt,
    render_vtt,
    split_windows,
    window_token_cap,
)
from gateway.audio.voices import VoiceRegistry, check_clip, trim_silence
from gateway.openai.errors import APIError
from services.common.deploy_profile import TranscriptionSettings, load_profile
from services.common.pb import code2wav_pb2, common_pb2, thinker_pb2


def test_sentences_and_segments() -> None:
    assert split_sentences("One. Two!  Three?\nFour 你好。世界") == [
        "One.",
        "Two!",
        "Three?",
        "Four 你好。",
        "世界",
    ]
    text = " ".join(f"Sentence {i} ends here." for i in range(60))
    segments = split_segments(text, limit=100)
    assert all(len(s) <= 100 for s in segments) and all(s.endswith(".") for s in segments)
    assert " ".join(segments) == text  # nothing lost, nothing reordered
    long_word = "a" * 250
    assert split_segments(long_word, limit=100) == ["a" * 100, "a" * 100, "a" * 50]
    clause = ", ".join(["clause"] * 40)
    assert all(len(s) <= 100 and not s.startswith(",") for s in split_segments(clause, limit=100))


def test_windows_cut_in_the_quietest_frame() -> None:
    rate = 16000
    x = np.full(70 * rate, 0.3, np.float32)
    x[int(26.0 * rate) : int(26.5 * rate)] = 0.0  # a pause inside the first window's seek range
    windows = split_windows(x)
    assert len(windows) == 3 and windows[0].start == 0 and windows[-1].end == 70
    assert 26.0 <= windows[0].end <= 26.5
    assert all(w.end - w.start <= 30 for w in windows)
    assert sum(w.samples.size for w in windows) == x.size
    assert len(split_windows(x[: 10 * rate])) == 1
    # The profile's 20 s windows: cut in each window's last third, at the pause when one is there.
    x[int(16.0 * rate) : int(16.3 * rate)] = 0.0
    short = split_windows(x, window_s=20.0)
    assert 16.0 <= short[0].end <= 16.3
    assert all(13.3 <= w.end - w.start <= 20 for w in short[:-1]) and short[-1].end == 70
    assert sum(w.samples.size for w in short) == x.size
    assert all(w.end - w.start <= 30 for w in split_windows(x, window_s=45.0))  # never past the encoder


def test_window_token_cap_follows_the_duration() -> None:
    settings = load_profile("minicpmo_4_5").gateway.transcription
    assert settings == TranscriptionSettings()  # the bundled profile keeps the documented defaults
    assert window_token_cap(20.0, settings) == 150 + 8  # 7.5 tokens/s
    assert window_token_cap(30.0, settings) == 225 + 8  # Whisper's 224 per 30 s window, plus a margin
    assert window_token_cap(0.1, settings) == 1 + 8
    assert window_token_cap(600.0, settings) == WINDOW_MAX_TOKENS
    assert window_token_cap(10.0, TranscriptionSettings(tokens_per_second=2.0, extra_tokens=0)) == 20
    overridden = load_profile("cpu").with_overrides({"gateway": {"transcription": {"window_s": 10}}})
    assert overridden.gateway.transcription.window_s == 10.0
    with pytest.raises(ValueError, match="window_s"):
        load_profile("cpu").with_overrides({"gateway": {"transcription": {"window_s": 31}}})


def test_srt_and_vtt() -> None:
    segs: list[dict[str, object]] = [
        {"start": 0.0, "end": 1.5, "text": "a"},
        {"start": 1.5, "end": 3661.25, "text": "b"},
    ]
    assert render_srt(segs) == "1\n00:00:00,000 --> 00:00:01,500\na\n\n2\n00:00:01,500 --> 01:01:01,250\nb\n"
    assert render_vtt(segs).startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\na\n")


def test_trim_and_clip_checks() -> None:
    rate = 16000
    tone = 0.2 * np.sin(np.arange(2 * rate) * 0.1).astype(np.float32)
    padded = np.concatenate([np.zeros(rate, np.float32), tone, np.zeros(rate, np.float32)])
    trimmed = trim_silence(padded, rate)
    assert abs(trimmed.size - tone.size) <= int(0.02 * rate)
    assert check_clip(padded, rate).size == trimmed.size
    with pytest.raises(APIError) as err:
        check_clip(padded[: int(1.5 * rate)], rate)  # 0.5 s of sound
    assert err.value.status == 400 and err.value.param == "file"
    with pytest.raises(APIError):
        check_clip(np.tile(tone, 16), rate)  # 32 s
    with pytest.raises(APIError):
        check_clip(np.zeros(3 * rate, np.float32), rate)


def _features() -> code2wav_pb2.VoicePrompt:
    t = common_pb2.Tensor(dtype=common_pb2.DTYPE_FLOAT32, shape=[1, 2], data=np.ones(2, "<f4").tobytes())
    return code2wav_pb2.VoicePrompt(tokens=t, mel=t, spk_emb=t, digest="abc")


def _rows() -> thinker_pb2.VoiceEmbedding:
    t = common_pb2.Tensor(dtype=common_pb2.DTYPE_FLOAT32, shape=[2, 4], data=np.ones(8, "<f4").tobytes())
    return thinker_pb2.VoiceEmbedding(embeds=t, digest="def")


def test_registry_files_names_and_resolution(tmp_path: Path) -> None:
    registry = VoiceRegistry(tmp_path)
    clip = (0.2 * np.sin(np.arange(32000) * 0.1)).astype(np.float32)
    meta = registry.store("v1", clip, 16000, _features(), _rows(), "hello")
    assert meta["duration_s"] == 2.0 and meta["ref_text"] == "hello"
    with pytest.raises(APIError) as err:
        registry.store("v1", clip, 16000, _features(), _rows(), None)
    assert err.value.status == 409
    assert (
        registry.resolve(None) is None
        and registry.resolve("alloy") is None
        and registry.resolve("default") is None
    )
    voice = registry.resolve("v1")
    assert voice is not None and voice.code2wav.digest == "abc" and voice.thinker.digest == "def"
    assert voice.clip.sample_rate == 16000
    assert sorted(p.name for p in (tmp_path / "v1").iterdir()) == [
        "clip.wav",
        "code2wav.pb",
        "meta.json",
        "thinker.pb",
    ]
    # another replica over the same directory
    other = VoiceRegistry(tmp_path)
    assert [v["name"] for v in other.list() if v["type"] == "uploaded"] == ["v1"]
    rt = other.realtime_voice("v1")
    assert rt is not None and rt.clip.size == 32000
    assert rt.thinker == _rows() and rt.code2wav == _features()  # the stored features travel as they are
    for bad in ("nobody", "../etc", ""):
        with pytest.raises(APIError) as err:
            registry.resolve(bad)
        assert err.value.status == 400 and err.value.param == "voice"
    with pytest.raises(APIError):
        VoiceRegistry.check_name("Shimmer")  # a built-in name, any case
    other.delete("v1")
    with pytest.raises(APIError):
        registry.resolve("v1")  # the first replica sees the deletion too
    with pytest.raises(APIError) as err:
        registry.delete("v1")
    assert err.value.status == 404
    assert not any(tmp_path.iterdir())
    with pytest.raises(APIError) as err:
        VoiceRegistry(None).store("x", clip, 16000, _features(), _rows(), None)
    assert err.value.status == 400


@pytest.mark.parametrize("fmt", SPEECH_FORMATS)
def test_stream_encoder_pieces_make_one_file(fmt: str) -> None:
    x = (0.3 * np.sin(np.arange(24000) * 0.05)).astype(np.float32)
    enc = StreamEncoder(fmt, 24000)
    pieces = [enc.push(x[i : i + 2400]) for i in range(0, 24000, 2400)] + [enc.close()]
    data = b"".join(pieces)
    if fmt == "pcm":
        assert len(data) == 48000
        return
    assert sum(1 for p in pieces[:-1] if p) >= 5  # bytes flow while pushing, not only at the end
    with av.open(io.BytesIO(data)) as container:
        frames = sum(f.samples for f in container.decode(audio=0))
    rate = 48000 if fmt == "opus" else 24000
    assert abs(frames - rate) < 0.1 * rate
    if fmt == "wav":
        assert data.startswith(wav_stream_header(24000))


def test_time_stretch_keeps_streaming() -> None:
    assert atempo_chain(0.25) == [0.5, 0.5] and atempo_chain(4.0) == [4.0]
    x = (0.3 * np.sin(np.arange(48000) * 0.05)).astype(np.float32)
    for speed in (0.25, 0.5, 1.0, 2.0, 4.0):
        stretch = TimeStretch(speed, 24000)
        out = [stretch.push(x[i : i + 4800]) for i in range(0, 48000, 4800)] + [stretch.flush()]
        total = sum(o.size for o in out)
        assert abs(total - 48000 / speed) < 0.03 * 48000 / speed
        assert sum(o.size for o in out[:-1]) > 0.5 * total  # output while input arrives
    with pytest.raises(ValueError):
        TimeStretch(5.0, 24000)


def test_realtime_session_voice_resolution() -> None:
    from gateway.audio.voices import RealtimeVoice
    from gateway.realtime.config import parse_session
    from gateway.realtime.errors import RealtimeError

    clip = np.full(16050, 0.1, np.float32)
    features = _features()
    rows = thinker_pb2.VoiceEmbedding(digest="r")

    def lookup(name: str) -> RealtimeVoice | None:
        return RealtimeVoice(clip, features, rows) if name == "host" else None

    cfg = parse_session({"modalities": ["text", "audio"], "voice": "host"}, voices=lookup)
    assert cfg.voice_prompt is features and cfg.thinker_voice is rows
    assert cfg.ref_audio is not None and cfg.ref_audio.size == 16000
    with pytest.raises(RealtimeError) as err:
        parse_session({"modalities": ["text", "audio"], "voice": "nobody"}, voices=lookup)
    assert err.value.code == "invalid_voice"
