"""Video input: frames at 1 fps, each encoded as one unsliced image (docs/model.md, Thinker inputs).

A frame becomes ``<image>`` + 64 ``<unk>`` + ``</image>`` = 66 tokens (``max_slice_nums = 1``, no image
id). Callers either pass frames already sampled at the profile's rate (the gRPC ``VideoPart.frames``) or
a container, which :func:`sample_video_frames` decodes and samples at ``fps``.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from services.thinker.errors import media_error

DEFAULT_FPS = 1.0


def sample_video_frames(
    data: bytes, param: str, fps: float = DEFAULT_FPS, max_frames: int = 64
) -> list[Image.Image]:
    """Decode a video container and keep the first frame at or after each ``1 / fps`` tick.

    Raises a typed media error when the bytes are not a decodable video or hold more than
    ``max_frames`` sampled frames.
    """
    import av

    if not data:
        raise media_error(param, "video data is empty")
    frames: list[Image.Image] = []
    try:
        with av.open(io.BytesIO(bytes(data))) as container:
            if not container.streams.video:
                raise media_error(param, "container has no video stream")
            stream = container.streams.video[0]
            next_tick = 0.0
            for frame in container.decode(stream):
                t = float(frame.time) if frame.time is not None else next_tick
                if t + 1e-6 < next_tick:
                    continue
                if len(frames) >= max_frames:
                    raise media_error(param, f"video has more than {max_frames} frames at {fps:g} fps")
                frames.append(frame.to_image().convert("RGB"))
                next_tick += 1.0 / fps
                while next_tick <= t:
                    next_tick += 1.0 / fps
    except (av.error.FFmpegError, ValueError, OSError) as exc:  # type: ignore[attr-defined]
        raise media_error(param, f"cannot decode video ({exc.__class__.__name__}: {exc})") from exc
    if not frames:
        raise media_error(param, "video has no decodable frames")
    return frames


def frame_placeholder(query_num: int, unk: str = "<unk>") -> str:
    return "<image>" + unk * query_num + "</image>"


def as_frame_list(frames: object) -> list[object]:
    if isinstance(frames, (list, tuple)):
        return list(frames)
    if isinstance(frames, np.ndarray) and frames.ndim == 4:
        return list(frames)
    return [frames]
