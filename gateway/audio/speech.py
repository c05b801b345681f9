"""``POST /v1/audio/speech``: OpenAI's text-to-speech on the omni model.

The spoken text is exactly ``input``: every segment (:mod:`gateway.audio.text`) is one run of the chat
pipeline (:mod:`gateway.pipeline`) whose thinker is teacher-forced over the segment
(``ThinkerOpen.teacher_text``: it prefills the prompt and the segment's tokens and samples nothing), so
the talker and code2wav see exactly what a spoken chat reply of that text would give them. The prompt is
the model's read-aloud template: a user turn ``["Please read the text below.", <segment>]``, the TTS
generation prompt ending in ``<|tts_bos|>``, and, when the request names a registered voice, the speech
system prompt with that voice's stored audio rows (the thinker builds it); ``instructions`` is a system
message.

Segments play back to back without gaps: segment k+1's run starts as soon as segment k produces its
first audio, and its output waits in a bounded queue until segment k is finished.

``speed`` is a pitch-preserving time stretch of the 24 kHz output (:mod:`gateway.audio.speed`).
``stream_format: "audio"`` (default) streams the encoded file as chunked bytes; ``"sse"`` streams
``speech.audio.delta`` events (base64 of the same bytes) and one ``speech.audio.done`` with usage. A
failure before the first byte is an HTTP error in the OpenAI envelope; after it, SSE gets an ``error``
event and a raw stream ends early.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from gateway.audio.common import (
    check_model,
    first_or_release,
    require_stages,
    runtime_of,
    voice_registry,
)
from gateway.audio.encoding import MIME_TYPES, StreamEncoder
from gateway.audio.speed import MAX_SPEED, MIN_SPEED, TimeStretch
from gateway.audio.text import split_segments
from gateway.audio.voices import RegisteredVoice
from gateway.openai.errors import error_body, invalid_request
from gateway.pipeline import OUTPUT_SAMPLE_RATE, AudioEvent, ChatJob, FinishEvent, PipelineRun
from gateway.runtime import GatewayRuntime
from gateway.stage_failure import StageFailure
from services.common.audio import resample
from services.common.pb import common_pb2, talker_pb2, thinker_pb2

log = logging.getLogger(__name__)
router = APIRouter()
MAX_INPUT_CHARS = 4096
READ_ALOUD_PROMPT = "Please read the text below."
PREFETCH_EVENTS = 64  # events a following segment may run ahead by
_HIDDEN_DTYPES = {
    "bfloat16": common_pb2.DTYPE_BFLOAT16,
    "float16": common_pb2.DTYPE_FLOAT16,
    "float32": common_pb2.DTYPE_FLOAT32,
}


class SpeechRequest(BaseModel):
    """The body of ``POST /v1/audio/speech`` (OpenAI's shape)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="the served model name (default: the one this server serves)")
    input: str = Field(
        ..., min_length=1, max_length=MAX_INPUT_CHARS, description="the text to speak, verbatim"
    )
    voice: str | None = Field(
        None,
        description="'default', an OpenAI voice name (all speak with the default voice) or a registered voice",
    )
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float = Field(1.0, ge=MIN_SPEED, le=MAX_SPEED, description="tempo factor; pitch is kept")
    instructions: str | None = Field(
        None, max_length=MAX_INPUT_CHARS, description="speaking style, given to the model as a system message"
    )
    stream_format: Literal["audio", "sse"] = "audio"


def _job(runtime: GatewayRuntime, req: SpeechRequest, segment: str, voice: RegisteredVoice | None) -> ChatJob:
    profile = runtime.config.profile
    thinker_p = profile.stage("thinker")
    talker_p = profile.stage("talker")
    talker_s = dict(talker_p.sampling)
    messages: list[thinker_pb2.ChatMessage] = []
    if req.instructions:
        messages.append(
            thinker_pb2.ChatMessage(role="system", content=[thinker_pb2.ContentPart(text=req.instructions)])
        )
    messages.append(
        thinker_pb2.ChatMessage(
            role="user",
            content=[thinker_pb2.ContentPart(text=READ_ALOUD_PROMPT), thinker_pb2.ContentPart(text=segment)],
        )
    )
    return ChatJob(
        request_id=f"speech-{uuid.uuid4().hex}",
        messages=messages,
        thinker_sampling=thinker_pb2.SamplingParams(),
        talker_sampling=talker_pb2.TalkerSampling(**talker_s),
        want_speech=True,
        use_tts_template=True,
        enable_thinking=False,
        thinker_voice=voice.thinker if voice is not None else None,
        voice_prompt=voice.code2wav if voice is not None else None,
        hidden_chunk_tokens=thinker_p.hidden_chunk_tokens,
        first_hidden_chunk_tokens=thinker_p.first_hidden_chunk_tokens,
        hidden_dtype=_HIDDEN_DTYPES[thinker_p.hidden_dtype],
        window_frames=talker_p.codec.window_frames,
        left_context_frames=talker_p.codec.left_context_frames,
        first_window_frames=talker_p.codec.first_window_frames,
        seed=talker_s.get("seed"),
        deadline_s=runtime.config.timeout_s,
        teacher_text=segment,
    )


_END = object()


class SegmentedSpeech:
    """Runs one pipeline per segment, the next one prefetched, and yields 24 kHz audio in order."""

    def __init__(self, runtime: GatewayRuntime, jobs: list[ChatJob]) -> None:
        self.runtime = runtime
        self.jobs = jobs
        self.runs: list[PipelineRun] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.queues: list[asyncio.Queue[object]] = []
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.audio_samples = 0

    def _start(self, index: int) -> None:
        run = self.runtime.pipeline.start(self.jobs[index])
        queue: asyncio.Queue[object] = asyncio.Queue(PREFETCH_EVENTS)
        self.runs.append(run)
        self.queues.append(queue)
        self.tasks.append(asyncio.create_task(self._drain(run, queue), name=f"{run.job.request_id}:speech"))

    @staticmethod
    async def _drain(run: PipelineRun, queue: asyncio.Queue[object]) -> None:
        try:
            async for event in run.events():
                await queue.put(event)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put(exc)
        await queue.put(_END)

    async def audio(self) -> AsyncIterator[np.ndarray]:
        try:
            self._start(0)
            for index in range(len(self.jobs)):
                queue = self.queues[index]
                while True:
                    item = await queue.get()
                    if item is _END:
                        break
                    if isinstance(item, BaseException):
                        raise item
                    if isinstance(item, AudioEvent):
                        if index + 1 < len(self.jobs) and len(self.runs) == index + 1:
                            self._start(index + 1)  # the next segment prefills while this one plays
                        samples = resample(item.samples, item.sample_rate, OUTPUT_SAMPLE_RATE)
                        self.audio_samples += int(samples.size)
                        yield samples
                    elif isinstance(item, FinishEvent):
                        self.prompt_tokens += item.prompt_tokens
                        self.completion_tokens += item.completion_tokens
                if index + 1 < len(self.jobs) and len(self.runs) == index + 1:
                    self._start(index + 1)  # a segment that produced no audio
        finally:
            self.abort()
            for task in self.tasks:
                with contextlib.suppress(BaseException):
                    await task

    def abort(self) -> None:
        for run in self.runs:
            run.abort()
        for task in self.tasks:
            task.cancel()


async def _encoded(speech: SegmentedSpeech, req: SpeechRequest) -> AsyncGenerator[bytes, None]:
    """Encoded bytes as they form (empty pieces skipped); the tail after the last segment."""
    encoder = StreamEncoder(req.response_format, OUTPUT_SAMPLE_RATE)
    stretch = TimeStretch(req.speed, OUTPUT_SAMPLE_RATE)
    finished = False
    try:
        async for samples in speech.audio():
            data = encoder.push(stretch.push(samples))
            if data:
                yield data
        tail = encoder.push(stretch.flush()) + encoder.close()
        finished = True
        if tail:
            yield tail
    finally:
        if not finished:
            encoder.abort()


def _sse(payload: dict[str, object]) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


@router.post(
    "/v1/audio/speech",
    response_class=Response,
    responses={
        200: {
            "description": "the audio file, streamed (or SSE events with stream_format 'sse')",
            "content": {**{mime: {} for mime in MIME_TYPES.values()}, "text/event-stream": {}},
        },
        400: {"description": "invalid input (OpenAI error envelope, with param)"},
    },
)
async def create_speech(request: Request, body: SpeechRequest) -> Response:
    """Speak ``input`` verbatim in the requested voice and format."""
    runtime = runtime_of(request)
    check_model(runtime, body.model)
    text = body.input.strip()
    if not text:
        raise invalid_request("input must contain text to speak", "input")
    voice = voice_registry(request).resolve(body.voice, "voice")
    jobs = [_job(runtime, body, segment, voice) for segment in split_segments(text)]
    require_stages(runtime, ("thinker", "talker", "code2wav"))
    runtime.acquire()
    speech = SegmentedSpeech(runtime, jobs)
    chunks = _encoded(speech, body)
    first = await first_or_release(chunks, runtime, b"")

    async def raw() -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            async for piece in chunks:
                yield piece
        except StageFailure as exc:
            log.warning("speech stream ended early: %s", exc.message)
        finally:
            await chunks.aclose()
            runtime.release()

    async def sse() -> AsyncIterator[bytes]:
        try:
            if first:
                yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(first).decode()})
            async for piece in chunks:
                yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(piece).decode()})
            usage = {
                "input_tokens": speech.prompt_tokens,
                "output_tokens": speech.completion_tokens,
                "total_tokens": speech.prompt_tokens + speech.completion_tokens,
            }
            yield _sse({"type": "speech.audio.done", "usage": usage})
        except StageFailure as exc:
            yield _sse({"type": "error", **error_body(exc.status, exc.message, exc.param, exc.err_type)})
        finally:
            await chunks.aclose()
            runtime.release()

    if body.stream_format == "sse":
        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return StreamingResponse(raw(), media_type=MIME_TYPES[body.response_format])
