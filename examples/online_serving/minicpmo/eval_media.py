"""Media packing shared by the evaluation tools (daily_omni.py, omni_duplex_eval.py, gradio_demo.py).

Frames are sampled with the gateway's own video decoder (:func:`gateway.media.decode_video`, JPEG at the
requested rate) and audio goes through the project's one audio module (:mod:`services.common.audio`), so
a tool sends the server exactly what the server would have cut from the same file itself.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np

from gateway.media import decode_video
from services.common.audio import read_audio, resample, wav_bytes
from services.common.deploy_profile import MediaLimits

AUDIO_RATE = 16_000  # the thinker's audio rate: one 1 s unit = 16 000 samples


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def load_audio_16k(source: str | Path | bytes) -> np.ndarray:
    """Any audio file libsndfile reads, as 16 kHz float32 mono."""
    samples, rate = read_audio(source)
    return resample(samples, rate, AUDIO_RATE)


def frames_at(video: bytes, fps: float = 1.0, max_frames: int = 64) -> list[bytes]:
    """JPEG frames of ``video`` at ``fps`` (evenly thinned to ``max_frames``), as the gateway samples them."""
    limits = MediaLimits(video_fps=fps, video_max_frames=max_frames, max_video_seconds=3_600.0)
    return decode_video(video, limits, "video").frames


def video_soundtrack_16k(video: bytes) -> np.ndarray | None:
    """The first audio stream of ``video`` at 16 kHz (``None`` when it has none)."""
    decoded = decode_video(video, MediaLimits(max_video_seconds=3_600.0), "video").soundtrack
    if decoded is None:
        return None
    return resample(decoded.samples, decoded.sample_rate, AUDIO_RATE)


def video_without_audio(video: bytes) -> bytes:
    """``video`` remuxed (no re-encode) with its audio streams dropped, so a request that also carries the
    soundtrack as its own audio part does not hand the model the same sound twice."""
    import av

    out = io.BytesIO()
    with av.open(io.BytesIO(video)) as src, av.open(out, mode="w", format="mp4") as dst:
        if not src.streams.audio:
            return video
        vin = src.streams.video[0]
        vout = dst.add_stream_from_template(vin)
        for packet in src.demux(vin):
            if packet.dts is None:  # the demuxer's flush packet
                continue
            packet.stream = vout
            dst.mux(packet)
    return out.getvalue()


def one_second_wavs(samples: np.ndarray, count: int | None = None) -> list[bytes]:
    """16 kHz audio cut into 1 s WAV files (the last one padded with silence); ``count`` pads or cuts the
    list to that many seconds, so it pairs one to one with 1 fps frames."""
    n = max(1, -(-samples.size // AUDIO_RATE)) if count is None else count
    padded = np.zeros(n * AUDIO_RATE, dtype=np.float32)
    keep = min(samples.size, padded.size)
    padded[:keep] = samples[:keep]
    return [wav_bytes(padded[i * AUDIO_RATE : (i + 1) * AUDIO_RATE], AUDIO_RATE) for i in range(n)]
