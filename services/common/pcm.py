"""Conversions between numpy audio samples and the proto ``Pcm`` message.

Kept apart from :mod:`services.common.tensors` because it needs only numpy: the gateway forwards audio
and must not import torch (its image ships without it).
"""

from __future__ import annotations

import numpy as np

from services.common.audio import float_to_pcm16, pcm16_to_float
from services.common.errors import INVALID_ARGUMENT, StageError
from services.common.pb import common_pb2


def pcm_from_float(
    samples: np.ndarray, sample_rate: int, fmt: common_pb2.PcmFormat = common_pb2.PCM_FORMAT_S16LE
) -> common_pb2.Pcm:
    """Mono float samples in [-1, 1] → Pcm message (s16le clips; f32le is lossless)."""
    x = np.asarray(samples, dtype=np.float32).reshape(-1)
    if fmt == common_pb2.PCM_FORMAT_F32LE:
        data = x.astype("<f4").tobytes()
    else:
        fmt = common_pb2.PCM_FORMAT_S16LE
        data = float_to_pcm16(x).tobytes()
    return common_pb2.Pcm(sample_rate=int(sample_rate), format=fmt, channels=1, data=data)


def pcm_to_float(msg: common_pb2.Pcm) -> tuple[np.ndarray, int]:
    """Pcm message → (mono float32 samples, sample rate); multi-channel input is averaged to mono."""
    if msg.sample_rate <= 0:
        raise StageError(INVALID_ARGUMENT, "pcm sample_rate must be positive", "sample_rate")
    channels = max(1, int(msg.channels))
    if msg.format == common_pb2.PCM_FORMAT_F32LE:
        if len(msg.data) % (4 * channels):
            raise StageError(
                INVALID_ARGUMENT, "f32le pcm byte length is not a whole number of frames", "data"
            )
        x = np.frombuffer(msg.data, dtype="<f4").astype(np.float32)
    elif msg.format in (common_pb2.PCM_FORMAT_S16LE, common_pb2.PCM_FORMAT_UNSPECIFIED):
        if len(msg.data) % (2 * channels):
            raise StageError(
                INVALID_ARGUMENT, "s16le pcm byte length is not a whole number of frames", "data"
            )
        x = pcm16_to_float(msg.data)
    else:
        raise StageError(INVALID_ARGUMENT, f"unsupported pcm format {msg.format}", "format")
    if channels > 1:
        x = x.reshape(-1, channels).mean(axis=1)
    return x, int(msg.sample_rate)
