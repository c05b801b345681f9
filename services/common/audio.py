"""The one audio toolbox of the project: resampling, float <-> PCM16, audio file read and write.

Every stage and the gateway convert audio through these functions, so one convention holds everywhere:

* **Scale.** A PCM16 sample ``s`` is the float ``s / 32768``; a float ``x`` becomes
  ``clip(round(x * 32768), -32768, 32767)``. Decoding then encoding gives back the same integers
  (``pcm16_to_float`` and ``float_to_pcm16`` are exact inverses on int16), and files read with
  soundfile (which also divides by 32768) agree with the wire format. libsndfile's own float writer
  scales by 32767, so the writers here convert to int16 first and hand soundfile integers.
* **Resampling.** :func:`resample` is soxr at its high quality setting: the resampler librosa uses by
  default (``res_type="soxr_hq"``), i.e. what upstream's ``librosa.load(path, sr=16000)`` does to a
  prompt before the thinker sees it. :func:`resample_torchaudio` exists only for code2wav's reference
  voice, where upstream's token2wav resamples with ``torchaudio.transforms.Resample`` and the speech
  tokenizer / speaker features must match it.
* **Files.** :func:`read_audio` decodes any container libsndfile knows (WAV, FLAC, OGG/Opus, MP3) to
  float32 mono; :func:`encode_file` / :func:`wav_bytes` write one complete file in memory.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import soundfile
import soxr

PCM16_SCALE = 32768.0
# Errors soundfile raises on bytes it cannot decode (LibsndfileError subclasses RuntimeError).
AUDIO_DECODE_ERRORS: tuple[type[Exception], ...] = (
    soundfile.LibsndfileError,
    RuntimeError,
    TypeError,
    ValueError,
)


def float_to_pcm16(samples: np.ndarray) -> np.ndarray:
    """Float samples (nominally in [-1, 1]) -> little-endian int16, clipped at full scale."""
    x = np.asarray(samples, dtype=np.float32) * PCM16_SCALE
    return np.clip(np.round(x), -32768, 32767).astype("<i2")


def pcm16_to_float(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """Little-endian int16 bytes (or an int16 array) -> float32 in [-1, 1)."""
    raw = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype="<i2")
    return raw.astype(np.float32) / PCM16_SCALE


def resample(samples: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """Mono float32 samples from ``src_rate`` to ``dst_rate`` with soxr (HQ), the project's resampler."""
    x = np.asarray(samples, dtype=np.float32)
    if int(src_rate) == int(dst_rate) or x.size == 0:
        return x
    out: np.ndarray = soxr.resample(x, int(src_rate), int(dst_rate), quality="HQ")
    return out.astype(np.float32, copy=False)


def resample_torchaudio(samples: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """Windowed-sinc resampling exactly as ``torchaudio.transforms.Resample`` with its defaults.

    Only for code2wav's reference voice: upstream's token2wav prepares the prompt wav with torchaudio's
    resampler, and the speech tokens and speaker embedding taken from it are part of the voice identity.
    """
    x = np.asarray(samples, dtype=np.float32)
    if int(src_rate) == int(dst_rate) or x.size == 0:
        return x
    import torch
    import torchaudio

    # The transform, not torchaudio.functional.resample: it builds its kernel differently (1e-7 apart).
    wave = torch.from_numpy(np.ascontiguousarray(x))[None]
    resampler = torchaudio.transforms.Resample(orig_freq=int(src_rate), new_freq=int(dst_rate))
    out: np.ndarray = resampler(wave)[0].numpy()
    return out


def to_mono(samples: np.ndarray) -> np.ndarray:
    """``[samples]`` or ``[samples, channels]`` -> float32 ``[samples]`` (channels averaged)."""
    x = np.asarray(samples)
    if x.ndim == 2:
        x = x.mean(axis=1)
    return x.astype(np.float32, copy=False)


def read_audio(source: bytes | bytearray | memoryview | str | Path) -> tuple[np.ndarray, int]:
    """An audio file's bytes or path -> (float32 mono samples, sample rate), decoded by soundfile.

    Raises one of :data:`AUDIO_DECODE_ERRORS` when libsndfile cannot read it; callers map that to their
    own typed error.
    """
    target = io.BytesIO(bytes(source)) if isinstance(source, (bytes, bytearray, memoryview)) else str(source)
    samples, rate = soundfile.read(target, dtype="float32", always_2d=True)
    return to_mono(samples), int(rate)


def encode_file(
    samples: np.ndarray, sample_rate: int, container: str = "WAV", subtype: str = "PCM_16"
) -> bytes:
    """Mono float samples -> the bytes of one complete file (soundfile container / subtype names).

    Samples are quantised to PCM16 first with :func:`float_to_pcm16` whatever the subtype, so every
    format carries the same integers the raw ``pcm`` output does.
    """
    data = float_to_pcm16(np.asarray(samples, dtype=np.float32).reshape(-1))  # our scale, not libsndfile's
    buf = io.BytesIO()
    soundfile.write(buf, data, int(sample_rate), format=container, subtype=subtype)
    return buf.getvalue()


def wav_bytes(samples: np.ndarray, sample_rate: int) -> bytes:
    """Mono float samples -> a standalone 16-bit PCM WAV file."""
    return encode_file(samples, sample_rate, "WAV", "PCM_16")


def write_wav(path: str | Path, samples: np.ndarray, sample_rate: int) -> None:
    """Mono float samples -> a 16-bit PCM WAV file on disk."""
    Path(path).write_bytes(wav_bytes(samples, sample_rate))
