"""Fetching and decoding request media (images, audio, video) into what the thinker accepts.

Sources: ``data:`` URLs (base64 or percent-encoded), ``file://`` paths only under the configured allowed
root (symlinks resolved before the check), and ``http(s)://`` only when fetching is enabled. Every
failure raises :class:`MediaError` with the HTTP status to answer (400 malformed, 413 over a limit,
403 source not allowed) and the request field it came from.

Decoding happens here, in the gateway, so that a corrupt file is a 400 before any stage does work:
images are verified with Pillow, audio is decoded with soundfile (PyAV for containers soundfile cannot
read), video with PyAV (frames sampled at the profile's fps and re-encoded as JPEG, soundtrack resampled
to 16 kHz mono).
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gateway.openai.errors import strip_object_reprs
from services.common.audio import AUDIO_DECODE_ERRORS, read_audio, resample
from services.common.deploy_profile import MediaLimits

THINKER_AUDIO_RATE = 16_000


# Pillow's own decompression-bomb guard (``Image.MAX_IMAGE_PIXELS``): Pillow warns above it and raises
# above twice it while reading the header, before any pixel is decoded. The gateway sets it to this value
# (above every profile's ``max_image_pixels``, 40 Mpx by default) and refuses both the warning and the error
# as 413 ``image_too_large``; the profile's own limit is then checked from the header size, also before
# decoding.
PIL_MAX_IMAGE_PIXELS = 64_000_000


class MediaError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str,
        code: str = "invalid_media",
        headers: dict[str, str] | None = None,
    ) -> None:
        message = strip_object_reprs(message)  # decoders put "<_io.BytesIO object at 0x...>" in their errors
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


@dataclass(frozen=True)
class MediaPolicy:
    """Where media may come from, plus the profile's size limits."""

    limits: MediaLimits
    allowed_root: Path | None = None
    http_fetch: bool = False
    http_timeout_s: float = 20.0


@dataclass
class DecodedAudio:
    samples: np.ndarray  # float32 mono
    sample_rate: int

    @property
    def seconds(self) -> float:
        return self.samples.size / float(self.sample_rate)


@dataclass
class DecodedVideo:
    frames: list[bytes]  # JPEG
    soundtrack: DecodedAudio | None
    seconds: float


def _decode_base64(data: str, param: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(400, f"{param}: invalid base64 data", param, "invalid_base64") from exc


def _data_url(url: str, param: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError(400, f"{param}: malformed data: URL (no comma)", param)
    if header.endswith(";base64"):
        return _decode_base64(payload.strip(), param)
    return urllib.parse.unquote_to_bytes(payload)


async def load_url(url: str, policy: MediaPolicy, param: str) -> bytes:
    """Bytes behind ``url`` per the source policy; size-capped."""
    if not isinstance(url, str) or not url:
        raise MediaError(400, f"{param}: expected a non-empty URL string", param)
    limit = policy.limits.max_media_bytes
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_url(url, param)
    elif scheme == "file":
        data = _read_local(url, policy, param)
    elif scheme in ("http", "https"):
        if not policy.http_fetch:
            raise MediaError(
                403,
                f"{param}: fetching http(s) media is disabled on this server (start with --enable-http-fetch)",
                param,
                "media_fetch_disabled",
            )
        data = await _fetch_http(url, policy, param)
    else:
        raise MediaError(
            400,
            f"{param}: unsupported URL scheme {scheme or url[:16]!r} (use data:, file:// or http(s))",
            param,
            "unsupported_url",
        )
    if len(data) > limit:
        raise MediaError(
            413, f"{param}: media is {len(data)} bytes, over the limit of {limit}", param, "media_too_large"
        )
    if not data:
        raise MediaError(400, f"{param}: media is empty", param)
    return data


def _read_local(url: str, policy: MediaPolicy, param: str) -> bytes:
    if policy.allowed_root is None:
        raise MediaError(
            403,
            f"{param}: file:// media is disabled (start with --allowed-media-root)",
            param,
            "media_path_not_allowed",
        )
    parsed = urllib.parse.urlparse(url)
    path = Path(urllib.parse.unquote(parsed.path)).resolve()
    root = policy.allowed_root.resolve()
    if not path.is_relative_to(root):
        raise MediaError(
            403, f"{param}: {path} is outside the allowed media root", param, "media_path_not_allowed"
        )
    if not path.is_file():
        raise MediaError(400, f"{param}: no such file {path}", param, "media_not_found")
    if path.stat().st_size > policy.limits.max_media_bytes:
        raise MediaError(413, f"{param}: file is over the media size limit", param, "media_too_large")
    return path.read_bytes()


async def _fetch_http(url: str, policy: MediaPolicy, param: str) -> bytes:
    import httpx

    limit = policy.limits.max_media_bytes
    try:
        async with httpx.AsyncClient(timeout=policy.http_timeout_s, follow_redirects=True) as client:
            async with client.stream("GET", url) as resp:
                if resp.status_code != 200:
                    raise MediaError(
                        400,
                        f"{param}: fetching {url} gave HTTP {resp.status_code}",
                        param,
                        "media_fetch_failed",
                    )
                buf = bytearray()
                async for piece in resp.aiter_bytes():
                    buf.extend(piece)
                    if len(buf) > limit:
                        raise MediaError(
                            413, f"{param}: remote media is over {limit} bytes", param, "media_too_large"
                        )
                return bytes(buf)
    except httpx.HTTPError as exc:
        raise MediaError(400, f"{param}: fetching {url} failed: {exc}", param, "media_fetch_failed") from exc


# ---- images ---------------------------------------------------------------------------------------
def _image_too_large(param: str, detail: str, limit: int) -> MediaError:
    return MediaError(
        413, f"{param}: image {detail}, over the limit of {limit} pixels", param, "image_too_large"
    )


def check_image(data: bytes, limits: MediaLimits, param: str) -> bytes:
    """Verify an encoded image; returns JPEG/PNG bytes (other formats are re-encoded as PNG).

    The pixel count comes from the header (``Image.open`` decodes nothing) and is refused before any
    decoding: Pillow's bomb guard (:data:`PIL_MAX_IMAGE_PIXELS`) first, then ``limits.max_image_pixels``.
    """
    import warnings

    from PIL import Image, UnidentifiedImageError

    Image.MAX_IMAGE_PIXELS = PIL_MAX_IMAGE_PIXELS
    limit = min(limits.max_image_pixels, PIL_MAX_IMAGE_PIXELS)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as probe:
                fmt = probe.format
                width, height = probe.size
                if width * height > limits.max_image_pixels:
                    raise _image_too_large(param, f"declares {width}x{height} pixels", limit)
                probe.verify()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise _image_too_large(param, "declares too many pixels (a decompression bomb)", limit) from exc
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise MediaError(400, f"{param}: not a decodable image ({exc})", param, "invalid_image") from exc
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                img.load()
                if fmt in ("JPEG", "PNG"):
                    return data
                out = io.BytesIO()
                img.convert("RGB").save(out, format="PNG")
                return out.getvalue()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise _image_too_large(param, "declares too many pixels (a decompression bomb)", limit) from exc
    except (OSError, ValueError) as exc:
        raise MediaError(
            400, f"{param}: image is truncated or corrupt ({exc})", param, "invalid_image"
        ) from exc


# ---- audio ----------------------------------------------------------------------------------------
def decode_audio(data: bytes, limits: MediaLimits, param: str) -> DecodedAudio:
    """Any common audio file -> float32 mono at its own rate (the thinker resamples).

    The duration the header declares is refused before decoding when it is over the limit; the decoded
    length is checked again (headers can lie, and PyAV-only formats have none here).
    """
    declared = _declared_audio_seconds(data)
    if declared is not None and declared > limits.max_audio_seconds:
        raise _audio_too_long(param, declared, limits.max_audio_seconds)
    try:
        audio = DecodedAudio(*read_audio(data))
    except AUDIO_DECODE_ERRORS:
        audio = _decode_audio_av(data, param, target_rate=None)
    if audio.samples.size == 0:
        raise MediaError(400, f"{param}: audio has no samples", param, "invalid_audio")
    if audio.seconds > limits.max_audio_seconds:
        raise _audio_too_long(param, audio.seconds, limits.max_audio_seconds)
    return audio


def _audio_too_long(param: str, seconds: float, limit: float) -> MediaError:
    return MediaError(
        413, f"{param}: audio lasts {seconds:.1f} s, over the limit of {limit:g} s", param, "audio_too_long"
    )


def _declared_audio_seconds(data: bytes) -> float | None:
    """The duration in a soundfile-readable header (WAV, FLAC, OGG, ...), None when it has none."""
    import soundfile

    try:
        info = soundfile.info(io.BytesIO(data))
    except Exception:  # noqa: BLE001 - not a libsndfile format: PyAV decodes it, the decoded length is checked
        return None
    if not info.samplerate or info.frames <= 0:
        return None
    return float(info.frames) / float(info.samplerate)


def _decode_audio_av(data: bytes, param: str, target_rate: int | None) -> DecodedAudio:
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.audio:
                raise MediaError(400, f"{param}: no audio stream found", param, "invalid_audio")
            return _read_audio_stream(container, container.streams.audio[0], target_rate)
    except MediaError:
        raise
    except Exception as exc:  # noqa: BLE001 - PyAV raises many FFmpeg error types
        raise MediaError(400, f"{param}: not a decodable audio file ({exc})", param, "invalid_audio") from exc


def _read_audio_stream(container, stream, target_rate: int | None) -> DecodedAudio:  # type: ignore[no-untyped-def]
    import av

    # PyAV only converts the sample format and layout (at the stream's own rate); the rate change, when
    # one is asked for, is services.common.audio's resampler like everywhere else.
    own_rate = int(stream.rate or THINKER_AUDIO_RATE)
    rate = target_rate or own_rate
    resampler = av.AudioResampler(format="flt", layout="mono", rate=own_rate)
    pieces: list[np.ndarray] = []
    for frame in container.decode(stream):
        for out in resampler.resample(frame):
            pieces.append(out.to_ndarray().reshape(-1))
    for out in resampler.resample(None):
        pieces.append(out.to_ndarray().reshape(-1))
    samples = np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)
    return DecodedAudio(resample(samples, own_rate, rate), int(rate))


# ---- video ----------------------------------------------------------------------------------------
def decode_video(data: bytes, limits: MediaLimits, param: str) -> DecodedVideo:
    """Frames at ``limits.video_fps`` (at most ``video_max_frames``, evenly thinned) + 16 kHz soundtrack."""
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except Exception as exc:  # noqa: BLE001
        raise MediaError(400, f"{param}: not a decodable video ({exc})", param, "invalid_video") from exc
    with container:
        if not container.streams.video:
            raise MediaError(400, f"{param}: no video stream found", param, "invalid_video")
        vstream = container.streams.video[0]
        duration = 0.0
        if container.duration:
            duration = container.duration / 1_000_000
        elif vstream.duration and vstream.time_base:
            duration = float(vstream.duration * vstream.time_base)
        if duration > limits.max_video_seconds:
            raise MediaError(
                413,
                f"{param}: video lasts {duration:.1f} s, over the limit of {limits.max_video_seconds:g} s",
                param,
                "video_too_long",
            )
        step = 1.0 / limits.video_fps
        frames: list[bytes] = []
        next_t = 0.0
        last_t = 0.0
        try:
            for frame in container.decode(vstream):
                t = float(frame.time) if frame.time is not None else next_t
                last_t = max(last_t, t)
                if t + 1e-6 < next_t:
                    continue
                img = frame.to_image()
                if img.width * img.height > limits.max_image_pixels:
                    raise MediaError(413, f"{param}: video frames are too large", param, "image_too_large")
                out = io.BytesIO()
                img.convert("RGB").save(out, format="JPEG", quality=90)
                frames.append(out.getvalue())
                next_t += step
                while next_t <= t:
                    next_t += step
        except MediaError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise MediaError(400, f"{param}: video decoding failed ({exc})", param, "invalid_video") from exc
    if not frames:
        raise MediaError(400, f"{param}: video has no decodable frames", param, "invalid_video")
    if len(frames) > limits.video_max_frames:
        keep = np.linspace(0, len(frames) - 1, limits.video_max_frames).round().astype(int)
        frames = [frames[i] for i in keep]
    soundtrack = _video_soundtrack(data, param)
    seconds = max(duration, last_t)
    if soundtrack is not None:
        seconds = max(seconds, soundtrack.seconds)
    if seconds > limits.max_video_seconds:
        raise MediaError(
            413, f"{param}: video is over {limits.max_video_seconds:g} s", param, "video_too_long"
        )
    return DecodedVideo(frames=frames, soundtrack=soundtrack, seconds=seconds)


def _video_soundtrack(data: bytes, param: str) -> DecodedAudio | None:
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.audio:
                return None
            audio = _read_audio_stream(container, container.streams.audio[0], THINKER_AUDIO_RATE)
    except Exception as exc:  # noqa: BLE001
        raise MediaError(
            400, f"{param}: video soundtrack could not be decoded ({exc})", param, "invalid_video"
        ) from exc
    return audio if audio.samples.size else None
