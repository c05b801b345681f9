"""The server-VAD detector (gateway/realtime/vad.py) on synthetic audio: exact boundaries, thresholds,
chunking independence, and validation of the ``server_vad`` configuration object."""

from __future__ import annotations

import numpy as np
import pytest
from realtime_helpers import tone
from speech_fixtures import feed

from gateway.realtime.vad import (
    DEFAULTS,
    FRAME_SAMPLES,
    EnergyVad,
    SpeechStarted,
    SpeechStopped,
    normalize_server_vad,
    speech_probability,
)

RATE = 16_000


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(round(seconds * RATE)), dtype=np.float32)


def noise(seconds: float, rms: float, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(round(seconds * RATE))) * rms).astype(np.float32)


def params(**overrides: object) -> dict[str, object]:
    return normalize_server_vad({"type": "server_vad", **overrides})


def run(audio: np.ndarray, chunk: int | None = None, **overrides: object) -> list[object]:
    return feed(EnergyVad(params(**overrides)), audio, chunk)


def test_probability_maps_dbfs_linearly() -> None:
    assert speech_probability(silence(0.02)) == 0.0
    assert speech_probability(tone(0.02, amp=0.3)) == 1.0
    assert speech_probability(np.full(FRAME_SAMPLES, 0.01, dtype=np.float32)) == pytest.approx(
        0.5
    )  # -40 dBFS
    assert speech_probability(np.full(FRAME_SAMPLES, 0.001, dtype=np.float32)) == pytest.approx(
        0.0, abs=1e-6
    )  # -60 dBFS
    assert speech_probability(np.full(FRAME_SAMPLES, 0.1, dtype=np.float32)) == pytest.approx(1.0)  # -20 dBFS


def test_tone_burst_boundaries_are_exact() -> None:
    audio = np.concatenate([silence(1.0), tone(1.0), silence(1.0)])
    events = run(audio)
    assert len(events) == 2
    start, stop = events
    assert isinstance(start, SpeechStarted) and isinstance(stop, SpeechStopped)
    assert start.speech_sample == 16_000  # the first voiced frame
    assert start.start_sample == 16_000 - 300 * 16  # 300 ms of prefix padding
    assert start.audio_start_ms == 700
    assert start.at_sample == 16_000 + 13 * FRAME_SAMPLES  # confirmed after ceil(250 / 20) voiced frames
    assert stop.end_sample == 32_000 + 25 * FRAME_SAMPLES  # after 500 ms of silence
    assert stop.audio_end_ms == 2_500


@pytest.mark.parametrize("chunk", [1, 17, 320, 3_200, 7_777])
def test_append_sizes_do_not_change_the_outcome(chunk: int) -> None:
    audio = np.concatenate([noise(0.4, 0.002), tone(0.7), silence(0.3), tone(0.5, freq=440.0), silence(0.9)])
    assert run(audio, chunk=chunk) == run(audio)


def test_silence_and_low_noise_never_start_speech() -> None:
    assert run(silence(3.0)) == []
    assert run(noise(3.0, rms=0.003)) == []  # about -50 dBFS: probability 0.25 < 0.5


def test_threshold_is_respected() -> None:
    quiet = noise(1.0, rms=0.003)
    assert [type(e) for e in run(quiet, threshold=0.2)] == [SpeechStarted]
    loud_enough = np.concatenate([silence(0.5), tone(1.0, amp=0.05)])  # RMS 0.035, about -29 dBFS
    assert run(loud_enough, threshold=0.9) == []
    assert [type(e) for e in run(loud_enough, threshold=0.7)] == [SpeechStarted]


def test_min_speech_duration_filters_short_bursts() -> None:
    short = np.concatenate([silence(0.5), tone(0.24), silence(1.0)])
    assert run(short) == []  # 12 voiced frames < 250 ms
    just_enough = np.concatenate([silence(0.5), tone(0.26), silence(1.0)])
    kinds = [type(e) for e in run(just_enough)]
    assert kinds == [SpeechStarted, SpeechStopped]
    # a dip inside the run restarts the count
    broken = np.concatenate([silence(0.5), tone(0.16), silence(0.04), tone(0.16), silence(1.0)])
    assert run(broken) == []
    assert [type(e) for e in run(broken, min_speech_duration_ms=100)] == [SpeechStarted, SpeechStopped]


def test_silence_duration_bridges_short_pauses() -> None:
    audio = np.concatenate([tone(0.5), silence(0.4), tone(0.5), silence(0.6)])
    events = run(audio)
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped]  # the 400 ms pause is not a turn end
    assert events[1].end_sample == 22_400 + 25 * FRAME_SAMPLES
    split = run(audio, silence_duration_ms=300)
    assert [type(e) for e in split] == [SpeechStarted, SpeechStopped, SpeechStarted, SpeechStopped]
    assert split[1].end_sample == 8_000 + 15 * FRAME_SAMPLES


def test_prefix_padding_never_reaches_before_the_previous_turn_or_a_reset() -> None:
    early = run(np.concatenate([silence(0.1), tone(0.5), silence(0.6)]))
    assert early[0].start_sample == 0  # only 100 ms exist before the speech
    audio = np.concatenate([tone(0.5), silence(0.5), silence(0.1), tone(0.5), silence(0.6)])
    events = run(audio, prefix_padding_ms=1_000)
    first_stop, second_start = events[1], events[2]
    assert second_start.speech_sample == 17_600
    assert second_start.start_sample == first_stop.end_sample  # padding clipped at the end of turn one
    vad = EnergyVad(params(prefix_padding_ms=1_000))
    vad.process(silence(1.0))
    vad.reset()
    started = vad.process(np.concatenate([silence(0.2), tone(0.5)]))
    assert started[0].start_sample == 16_000  # not before the reset


def test_reset_forgets_speech_in_progress() -> None:
    vad = EnergyVad(params())
    assert [type(e) for e in vad.process(tone(0.5))] == [SpeechStarted]
    vad.reset()
    assert vad.process(silence(1.0)) == []  # no stop for the forgotten speech
    assert vad.clock == 24_000


def test_normalize_fills_defaults_and_rejects_bad_objects() -> None:
    assert normalize_server_vad({"type": "server_vad"}) == DEFAULTS
    assert DEFAULTS["detector"] == "silero"
    assert normalize_server_vad({"type": "server_vad", "detector": "energy"})["detector"] == "energy"
    custom = normalize_server_vad(
        {
            "type": "server_vad",
            "threshold": 1,
            "prefix_padding_ms": 0.0,
            "silence_duration_ms": 800,
            "create_response": False,
        }
    )
    assert (
        custom["threshold"] == 1.0
        and custom["prefix_padding_ms"] == 0
        and custom["silence_duration_ms"] == 800
    )
    assert custom["create_response"] is False and custom["interrupt_response"] is True
    bad = [
        {"idle_timeout_ms": 1000},
        {"eagerness": "auto"},
        {"threshold": 0},
        {"threshold": 1.01},
        {"threshold": True},
        {"threshold": "0.5"},
        {"interrupt_response": False},
        {"interrupt_response": "yes"},
        {"create_response": 1},
        {"silence_duration_ms": 10},
        {"silence_duration_ms": 20.5},
        {"prefix_padding_ms": -1},
        {"min_speech_duration_ms": 6_000},
        {"detector": "webrtc"},
        {"detector": True},
    ]
    for extra in bad:
        with pytest.raises(ValueError):
            normalize_server_vad({"type": "server_vad", **extra})
