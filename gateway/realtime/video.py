"""Video frame intake for appends (docs/protocol.md, Realtime input): at most two bare base64 JPEG/PNG
frames."""

from __future__ import annotations

import base64
import binascii

from gateway.realtime.errors import RealtimeError

MAX_FRAMES = 2
MAX_FRAME_B64_CHARS = 4_000_000
_JPEG_MAGIC = b"\xff\xd8\xff"
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def decode_video_frames(frames: object, max_slice_nums: object = None) -> list[bytes]:
    """Validate and decode ``video_frames``; every violation is ``invalid_video_frames`` (invariant I2)."""
    if max_slice_nums not in (None, 1):
        raise RealtimeError(
            "invalid_video_frames", "max_slice_nums must be null or 1", param="max_slice_nums"
        )
    if frames is None:
        return []
    if not isinstance(frames, list):
        raise RealtimeError("invalid_video_frames", "video_frames must be a list", param="video_frames")
    if len(frames) > MAX_FRAMES:
        raise RealtimeError(
            "invalid_video_frames", f"at most {MAX_FRAMES} video frames per append", param="video_frames"
        )
    out: list[bytes] = []
    for i, frame in enumerate(frames):
        param = f"video_frames[{i}]"
        if not isinstance(frame, str) or not frame:
            raise RealtimeError("invalid_video_frames", "each frame must be a base64 string", param=param)
        if frame.startswith("data:"):
            raise RealtimeError(
                "invalid_video_frames", "frames must be bare base64, not data: URLs", param=param
            )
        if len(frame) > MAX_FRAME_B64_CHARS:
            raise RealtimeError(
                "invalid_video_frames", f"frame exceeds {MAX_FRAME_B64_CHARS} base64 characters", param=param
            )
        try:
            raw = base64.b64decode(frame, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise RealtimeError("invalid_video_frames", "frame is not valid base64", param=param) from exc
        if not (raw.startswith(_JPEG_MAGIC) or raw.startswith(_PNG_MAGIC)):
            raise RealtimeError("invalid_video_frames", "frames must be JPEG or PNG", param=param)
        out.append(raw)
    return out
