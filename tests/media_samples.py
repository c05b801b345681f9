"""Small synthesized media for gateway tests: PNG image, WAV tone, MP4 with an audio track."""

from __future__ import annotations

import base64
import io

import numpy as np


def png_bytes(width: int = 64, height: int = 48) -> bytes:
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack(
        [x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), np.full_like(x, 128)], axis=-1
    )
    buf = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def wav_bytes(seconds: float = 1.0, rate: int = 16000, freq: float = 330.0) -> bytes:
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(
        buf, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), rate, format="WAV", subtype="PCM_16"
    )
    return buf.getvalue()


def mp4_bytes(
    seconds: float = 3.0, fps: int = 10, size: tuple[int, int] = (64, 48), audio_rate: int = 22050
) -> bytes:
    """H.264/MPEG-4 video with a moving gradient and an AAC tone track."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        vs = out.add_stream("mpeg4", rate=fps)
        vs.width, vs.height = size
        vs.pix_fmt = "yuv420p"
        aus = out.add_stream("aac", rate=audio_rate)
        aus.layout = "mono"
        for i in range(int(seconds * fps)):
            img = np.zeros((size[1], size[0], 3), dtype=np.uint8)
            img[:, :, 0] = (i * 20) % 255
            img[:, : (i * 5) % size[0], 1] = 200
            for packet in vs.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in vs.encode():
            out.mux(packet)
        t = np.arange(int(seconds * audio_rate)) / audio_rate
        tone = (0.2 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
        step = 1024
        for start in range(0, tone.size, step):
            frame = av.AudioFrame.from_ndarray(tone[None, start : start + step], format="fltp", layout="mono")
            frame.sample_rate = audio_rate
            frame.pts = start
            for packet in aus.encode(frame):
                out.mux(packet)
        for packet in aus.encode():
            out.mux(packet)
    return buf.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def bomb_png(width: int = 30_000, height: int = 30_000, payload: int = 100_000) -> bytes:
    """A decompression-bomb PNG: a valid header declaring ``width``x``height`` grey pixels, and about
    ``payload`` bytes of zlib data (a few MB of zero rows) - tiny on the wire, gigabytes once decoded."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    rows = zlib.compress(b"\0" * (payload * 1000), 9)[:payload]
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")
