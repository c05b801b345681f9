"""services.common.audio: one PCM16 scale both ways, the soxr resampler, files through soundfile."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile

from services.common.audio import (
    encode_file,
    float_to_pcm16,
    pcm16_to_float,
    read_audio,
    resample,
    resample_torchaudio,
    wav_bytes,
)
from services.common.pb import common_pb2
from services.common.pcm import pcm_from_float, pcm_to_float


def _tone(seconds: float, rate: int, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.4 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def test_pcm16_decode_then_encode_is_the_identity_on_every_int16() -> None:
    every = np.arange(-32768, 32768, dtype=np.int32).astype("<i2")
    assert np.array_equal(float_to_pcm16(pcm16_to_float(every.tobytes())), every)
    assert float_to_pcm16(np.array([1.0, -1.0, 2.0, -2.0, 0.5], np.float32)).tolist() == [
        32767,
        -32768,
        32767,
        -32768,
        16384,
    ]


def test_the_wire_format_and_soundfile_agree_on_the_scale() -> None:
    x = _tone(0.1, 16_000)
    wire, _ = pcm_to_float(pcm_from_float(x, 16_000, common_pb2.PCM_FORMAT_S16LE))
    from_file, rate = read_audio(wav_bytes(x, 16_000))
    assert rate == 16_000 and np.array_equal(wire, from_file)


def test_resample_is_librosas_default_resampler() -> None:
    """The thinker's fidelity claim: upstream brings audio to 16 kHz with librosa's default (soxr_hq)."""
    librosa = pytest.importorskip("librosa")
    x = _tone(0.5, 24_000)
    ours = resample(x, 24_000, 16_000)
    assert ours.dtype == np.float32 and ours.shape == (8000,)
    assert np.array_equal(ours, librosa.resample(x, orig_sr=24_000, target_sr=16_000))
    assert resample(x, 24_000, 24_000) is x


def test_resample_torchaudio_matches_the_transform_upstream_uses() -> None:
    import torch
    import torchaudio

    x = _tone(0.5, 22_050)
    want = torchaudio.transforms.Resample(orig_freq=22_050, new_freq=16_000)(torch.from_numpy(x)[None])[0]
    assert np.array_equal(resample_torchaudio(x, 22_050, 16_000), want.numpy())


@pytest.mark.parametrize(("container", "subtype"), [("WAV", "PCM_16"), ("FLAC", "PCM_16")])
def test_lossless_files_carry_the_pcm16_integers(container: str, subtype: str) -> None:
    x = _tone(0.2, 24_000)
    data = encode_file(x, 24_000, container, subtype)
    import io

    ints, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    assert rate == 24_000 and np.array_equal(ints, float_to_pcm16(x))


def test_read_audio_averages_channels_to_mono() -> None:
    import io

    stereo = np.stack([_tone(0.1, 8000), np.zeros(800, np.float32)], axis=1)
    buf = io.BytesIO()
    soundfile.write(buf, float_to_pcm16(stereo.reshape(-1)).reshape(-1, 2), 8000, format="WAV")
    mono, rate = read_audio(buf.getvalue())
    assert rate == 8000 and mono.shape == (800,)
    assert np.allclose(mono, pcm16_to_float(float_to_pcm16(stereo[:, 0])) / 2, atol=1 / 32768)
