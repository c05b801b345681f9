"""``/v1/audio/voices``: register (multipart ``name``, ``file``, optional ``ref_text``), list and delete.

Registration checks the clip here (decodable by soundfile or PyAV, 1-30 s of sound after trimming
leading and trailing silence), asks the stages once for what they derive from a reference (both
``EncodeVoice`` RPCs, concurrently: code2wav's S3 prompt tokens, prompt mel and speaker x-vector, the
thinker's audio-encoder rows for its speech system prompt) and stores them beside the clip
(:mod:`gateway.audio.voices`). Requests naming the voice then send the stored features.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import grpc
import numpy as np
from fastapi import APIRouter, File, Form, Request, UploadFile
from pydantic import BaseModel

from gateway.audio.common import require_stages, runtime_of, stage_api_error, voice_registry
from gateway.audio.voices import check_clip
from gateway.media import MediaError, decode_audio
from gateway.openai.errors import invalid_request
from gateway.stage_failure import StageFailure
from services.common.deploy_profile import MediaLimits
from services.common.pb import code2wav_pb2, thinker_pb2
from services.common.pcm import pcm_from_float

router = APIRouter()
ENCODE_TIMEOUT_S = 60.0
MAX_REF_TEXT = 4096


class VoiceObject(BaseModel):
    """One voice of the list (built-in voices have only name, type and description)."""

    name: str
    type: str
    description: str | None = None
    created_at: int | None = None
    duration_s: float | None = None
    sample_rate: int | None = None
    ref_text: str | None = None
    digest: str | None = None


class VoiceList(BaseModel):
    object: str = "list"
    data: list[VoiceObject]


class VoiceDeleted(BaseModel):
    name: str
    object: str = "voice"
    deleted: bool = True


async def read_upload(file: UploadFile, limit: int, param: str = "file") -> bytes:
    """The uploaded file's bytes: 400 when empty, 413 over ``limit``."""
    data = await file.read(limit + 1)
    if len(data) > limit:
        raise invalid_request(f"{param} is over the limit of {limit} bytes", param, "file_too_large", 413)
    if not data:
        raise invalid_request(f"{param} is empty", param, "empty_file")
    return data


def decode_upload(data: bytes, limits: MediaLimits, param: str = "file") -> tuple[np.ndarray, int]:
    """Decoded mono float samples and rate; a file that is not audio is a 400 naming ``param``."""
    try:
        audio = decode_audio(data, limits, param)
    except MediaError as exc:
        if exc.status == 413:
            raise invalid_request(exc.message, param, "audio_too_long", 413) from exc
        raise invalid_request(exc.message, param, "invalid_audio") from exc
    return audio.samples, audio.sample_rate


@router.post("/v1/audio/voices", response_model=VoiceObject)
async def create_voice(
    request: Request,
    name: Annotated[str, Form(description="the voice's name (letters, digits, '_', '-', '.')")],
    file: Annotated[
        UploadFile, File(description="a 1-30 s reference clip (any format PyAV or soundfile reads)")
    ],
    ref_text: Annotated[
        str | None, Form(max_length=MAX_REF_TEXT, description="what the clip says (kept as metadata)")
    ] = None,
) -> VoiceObject:
    runtime = runtime_of(request)
    registry = voice_registry(request)
    registry.check_name(name)
    root = registry.require_root()
    if (root / name).exists():
        raise invalid_request(
            f"voice {name!r} already exists; DELETE /v1/audio/voices/{name} first",
            "name",
            "voice_exists",
            409,
        )
    data = await read_upload(file, runtime.config.body_limit)
    samples, rate = await asyncio.to_thread(decode_upload, data, runtime.media_policy.limits)
    clip = check_clip(samples, rate)
    require_stages(runtime, ("thinker", "code2wav"))
    pcm = pcm_from_float(clip, rate)

    async def encode(stage: str, request: object) -> Any:
        client = runtime.stages[stage]
        try:
            return await client.pick().stub.EncodeVoice(request, timeout=ENCODE_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise invalid_request(
                    f"the voice clip cannot be used: {err.details()}", "file", "invalid_audio"
                ) from err
            raise stage_api_error(StageFailure.from_rpc_error(stage, client.target, err)) from err

    features, rows = await asyncio.gather(
        encode("code2wav", code2wav_pb2.Code2WavVoiceRequest(ref_audio=pcm)),
        encode("thinker", thinker_pb2.ThinkerVoiceRequest(ref_audio=pcm)),
    )
    meta = await asyncio.to_thread(registry.store, name, clip, rate, features, rows, ref_text)
    return VoiceObject(**meta)  # type: ignore[arg-type]


@router.get("/v1/audio/voices", response_model=VoiceList)
async def list_voices(request: Request) -> VoiceList:
    registry = voice_registry(request)
    items = await asyncio.to_thread(registry.list)
    return VoiceList(data=[VoiceObject(**item) for item in items])  # type: ignore[arg-type]


@router.delete("/v1/audio/voices/{name}", response_model=VoiceDeleted)
async def delete_voice(request: Request, name: str) -> VoiceDeleted:
    await asyncio.to_thread(voice_registry(request).delete, name)
    return VoiceDeleted(name=name)
