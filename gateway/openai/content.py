"""Turning validated chat messages into thinker ``ChatMessage`` protos (fetching and decoding media).

Decoding is CPU work (PIL, soundfile, PyAV), so it runs on the bounded media pool
(:mod:`gateway.media_pool`) and the event loop keeps serving other requests meanwhile.
"""

from __future__ import annotations

import asyncio
import base64
import binascii

from gateway.media import MediaError, MediaPolicy, check_image, decode_audio, decode_video, load_url
from gateway.media_pool import MEDIA_POOL
from gateway.openai.errors import INVALID_REQUEST, APIError
from gateway.openai.protocol import ContentPart, Message
from services.common.pb import common_pb2, thinker_pb2
from services.common.pcm import pcm_from_float


def _media_api_error(exc: MediaError) -> APIError:
    err_type = INVALID_REQUEST if exc.status < 500 else None
    return APIError(exc.status, exc.message, exc.param, err_type, exc.headers, exc.code)


async def _part_bytes(part: ContentPart, policy: MediaPolicy) -> bytes:
    if part.type == "input_audio":
        assert part.data is not None
        data = part.data
        if data.startswith("data:"):
            return await load_url(data, policy, f"{part.param}.input_audio.data")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise MediaError(
                400, f"{part.param}.input_audio.data: invalid base64", f"{part.param}.input_audio.data"
            ) from exc
        if len(raw) > policy.limits.max_media_bytes:
            raise MediaError(413, f"{part.param}: audio is over the media size limit", part.param)
        return raw
    assert part.url is not None
    return await load_url(part.url, policy, f"{part.param}.{part.type}.url")


async def _convert_part(part: ContentPart, policy: MediaPolicy) -> thinker_pb2.ContentPart:
    if part.type == "text":
        return thinker_pb2.ContentPart(text=part.text or "")
    data = await _part_bytes(part, policy)
    limits = policy.limits
    if part.type == "image_url":
        image = await MEDIA_POOL.run(check_image, data, limits, part.param, param=part.param)
        return thinker_pb2.ContentPart(image=thinker_pb2.ImagePart(data=image))
    if part.type in ("input_audio", "audio_url"):
        audio = await MEDIA_POOL.run(decode_audio, data, limits, part.param, param=part.param)
        return thinker_pb2.ContentPart(
            audio=thinker_pb2.AudioPart(pcm=pcm_from_float(audio.samples, audio.sample_rate))
        )
    video = await MEDIA_POOL.run(decode_video, data, limits, part.param, param=part.param)
    vpart = thinker_pb2.VideoPart(frames=video.frames)
    if video.soundtrack is not None:
        vpart.soundtrack.CopyFrom(pcm_from_float(video.soundtrack.samples, video.soundtrack.sample_rate))
    return thinker_pb2.ContentPart(video=vpart)


def _check_counts(messages: list[Message], policy: MediaPolicy) -> None:
    limits = policy.limits
    counts = {"image": 0, "audio": 0, "video": 0}
    for msg in messages:
        for part in msg.parts:
            if part.type == "image_url":
                counts["image"] += 1
            elif part.type in ("input_audio", "audio_url"):
                counts["audio"] += 1
            elif part.type == "video_url":
                counts["video"] += 1
    caps = {"image": limits.max_images, "audio": limits.max_audios, "video": limits.max_videos}
    for kind, n in counts.items():
        if n > caps[kind]:
            raise APIError(
                400,
                f"at most {caps[kind]} {kind} part(s) per request are accepted, got {n}",
                "messages",
                INVALID_REQUEST,
                code="too_many_media_parts",
            )


async def build_thinker_messages(
    messages: list[Message], policy: MediaPolicy
) -> list[thinker_pb2.ChatMessage]:
    """Decode every part (media in parallel threads); raises :class:`APIError` on the first bad part."""
    _check_counts(messages, policy)
    try:
        converted = await asyncio.gather(
            *(asyncio.gather(*(_convert_part(p, policy) for p in msg.parts)) for msg in messages)
        )
    except MediaError as exc:
        raise _media_api_error(exc) from exc
    return [
        thinker_pb2.ChatMessage(
            role=msg.role,
            content=list(parts),
            tool_calls=[
                thinker_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in msg.tool_calls
            ],
            tool_call_id=msg.tool_call_id or "",
        )
        for msg, parts in zip(messages, converted, strict=True)
    ]


async def load_ref_audio(uri: str, policy: MediaPolicy) -> common_pb2.Pcm:
    """The reference voice as mono PCM at its own rate; 400 when it is not decodable audio."""
    try:
        data = await load_url(uri, policy, "ref_audio")
        audio = await MEDIA_POOL.run(decode_audio, data, policy.limits, "ref_audio", param="ref_audio")
    except MediaError as exc:
        raise _media_api_error(exc) from exc
    return pcm_from_float(audio.samples, audio.sample_rate)
