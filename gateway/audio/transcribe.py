"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``: speech to text on the thinker alone.

The uploaded file is decoded by soundfile or PyAV, resampled to the audio encoder's 16 kHz and cut into
windows of at most ``gateway.transcription.window_s`` seconds (20 by default, at most the encoder's 30)
at the quietest 20 ms frame of each window's last third, so a cut falls in a pause rather than inside a
word. Each window is one thinker-only run (no talker, no code2wav) with the model's own transcription
instruction (docs/model.md, "Transcription"): a user turn ``[<instruction>, <audio>]``, no TTS template.
Windows run concurrently (at most ``max_parallel_windows``) and their text is joined in order; each
window is one timed segment of ``verbose_json`` / ``srt`` / ``vtt``.

A window's text is bounded by its duration (:func:`window_token_cap`): ``tokens_per_second`` (7.5, the
budget Whisper's decoder gives a 30 s window: 224 sampled tokens) times its seconds plus a few tokens,
so a decoder that never says end-of-text (a looping hallucination, or random weights) stops after as
many steps as speech of that length can need, and the request's latency is bounded by its longest
window, not by a fixed 448-token budget.

``stream: true`` answers Server-Sent Events: ``transcript.text.delta`` per piece of text as the thinker
writes it (windows in order) and one ``transcript.text.done`` with the whole text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Annotated

import numpy as np
from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from gateway.audio.common import check_model, first_or_release, require_stages, runtime_of, stage_api_error
from gateway.audio.voice_routes import decode_upload, read_upload
from gateway.openai.errors import error_body, invalid_request
from gateway.pipeline import ChatJob, FinishEvent, PipelineRun, TextEvent
from gateway.runtime import GatewayRuntime
from gateway.stage_failure import StageFailure
from services.common.audio import resample
from services.common.deploy_profile import TranscriptionSettings
from services.common.pb import talker_pb2, thinker_pb2
from services.common.pcm import pcm_from_float

router = APIRouter()
ENCODER_RATE = 16_000
WINDOW_S = 30.0  # the audio encoder's position table: no window is longer
SEEK_S = 10.0  # a cut is searched in at most this much (and at most the last third) of a window
FRAME_S = 0.02
WINDOW_MAX_TOKENS = 448  # Whisper's whole text context; no window's text is longer, whatever its cap
RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
# The model's own instructions (docs/model.md, "Transcription").
TRANSCRIBE_PROMPT = "Please listen to the audio snippet carefully and transcribe the content."
TRANSCRIBE_PROMPT_ZH = "请仔细听这段音频片段，并对其内容进行逐字记录。"
TRANSLATE_PROMPT = "Please listen to the audio snippet carefully and translate the content into English."
_CJK = re.compile(r"[\u3400-\u9fff]")


@dataclass
class Window:
    start: float
    end: float
    samples: np.ndarray


def split_windows(samples: np.ndarray, rate: int = ENCODER_RATE, window_s: float = WINDOW_S) -> list[Window]:
    """``samples`` as consecutive windows of at most ``window_s`` seconds, cut at the quietest frame of the
    last third (at most :data:`SEEK_S` seconds) of each window."""
    x = np.asarray(samples, dtype=np.float32).reshape(-1)
    limit = int(min(window_s, WINDOW_S) * rate)
    frame = int(FRAME_S * rate)
    seek = max(frame, int(min(SEEK_S, window_s / 3) * rate))
    out: list[Window] = []
    start = 0
    while x.size - start > limit:
        lo, hi = start + limit - seek, start + limit
        n = (hi - lo) // frame
        energy = np.mean(x[lo : lo + n * frame].reshape(n, frame).astype(np.float64) ** 2, axis=1)
        cut = lo + int(np.argmin(energy)) * frame + frame // 2
        out.append(Window(start / rate, cut / rate, x[start:cut]))
        start = cut
    if x.size - start > 0 or not out:
        out.append(Window(start / rate, x.size / rate, x[start:]))
    return out


def window_token_cap(seconds: float, settings: TranscriptionSettings) -> int:
    """Most tokens a window of ``seconds`` may write: ``tokens_per_second`` x its duration + ``extra_tokens``,
    at most :data:`WINDOW_MAX_TOKENS` (at least 1).

    7.5 tokens/s is Whisper's own budget (224 sampled tokens per 30 s window); fast speech is about 3
    words/s in English (~4 tokens) and 5-6 characters/s in Chinese (~1 token each), so real speech ends
    (end-of-text) well before the cap, and only a decoder that never ends (a looping hallucination, random
    weights) reaches it."""
    cap = math.ceil(settings.tokens_per_second * max(seconds, 0.0)) + settings.extra_tokens
    return max(1, min(WINDOW_MAX_TOKENS, cap))


def _instruction(task: str, language: str | None) -> str:
    if task == "translate":
        return TRANSLATE_PROMPT
    return TRANSCRIBE_PROMPT_ZH if (language or "").lower().startswith("zh") else TRANSCRIBE_PROMPT


def _job(
    runtime: GatewayRuntime,
    window: Window,
    task: str,
    language: str | None,
    prompt: str | None,
    temperature: float,
) -> ChatJob:
    thinker_p = runtime.config.profile.stage("thinker")
    sampling = dict(thinker_p.sampling)
    sampling["temperature"] = temperature
    cap = window_token_cap(window.end - window.start, runtime.config.profile.gateway.transcription)
    sampling["max_tokens"] = min(int(sampling.get("max_tokens", cap)), cap)
    messages = []
    if prompt:  # OpenAI's `prompt`: context for the transcript (spelling, earlier text), as a system turn
        messages.append(
            thinker_pb2.ChatMessage(role="system", content=[thinker_pb2.ContentPart(text=prompt)])
        )
    audio = thinker_pb2.AudioPart(pcm=pcm_from_float(window.samples, ENCODER_RATE))
    messages.append(
        thinker_pb2.ChatMessage(
            role="user",
            content=[
                thinker_pb2.ContentPart(text=_instruction(task, language)),
                thinker_pb2.ContentPart(audio=audio),
            ],
        )
    )
    return ChatJob(
        request_id=f"{task}-{uuid.uuid4().hex}",
        messages=messages,
        thinker_sampling=thinker_pb2.SamplingParams(**sampling),
        talker_sampling=talker_pb2.TalkerSampling(),
        want_speech=False,
        use_tts_template=False,
        enable_thinking=False,
        deadline_s=runtime.config.timeout_s,
    )


class WindowedTranscript:
    """Runs every window (bounded concurrency) and yields ``(window index, text piece)`` in order."""

    def __init__(self, runtime: GatewayRuntime, jobs: list[ChatJob], parallel: int) -> None:
        self.runtime = runtime
        self.jobs = jobs
        self.queues: list[asyncio.Queue[object]] = [asyncio.Queue() for _ in jobs]
        self.runs: list[PipelineRun] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.slots = asyncio.Semaphore(parallel)
        self.texts: list[str] = ["" for _ in jobs]
        self.prompt_tokens = 0
        self.completion_tokens = 0

    async def _run(self, index: int) -> None:
        queue = self.queues[index]
        async with self.slots:
            run = self.runtime.pipeline.start(self.jobs[index])
            self.runs.append(run)
            try:
                async for event in run.events():
                    await queue.put(event)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                await queue.put(exc)
            await queue.put(None)

    async def pieces(self) -> AsyncGenerator[tuple[int, str], None]:
        try:
            self.tasks = [asyncio.create_task(self._run(i)) for i in range(len(self.jobs))]
            for index, queue in enumerate(self.queues):
                while True:
                    item = await queue.get()
                    if item is None:
                        break
                    if isinstance(item, BaseException):
                        raise item
                    if isinstance(item, TextEvent) and item.text:
                        self.texts[index] += item.text
                        yield index, item.text
                    elif isinstance(item, FinishEvent):
                        self.prompt_tokens += item.prompt_tokens
                        self.completion_tokens += item.completion_tokens
        finally:
            for run in self.runs:
                run.abort()
            for task in self.tasks:
                task.cancel()
            for task in self.tasks:
                with contextlib.suppress(BaseException):
                    await task


def _timestamp(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def render_srt(segments: list[dict[str, object]]) -> str:
    blocks = [
        f"{i + 1}\n{_timestamp(float(seg['start']), ',')} --> {_timestamp(float(seg['end']), ',')}\n{seg['text']}\n"  # type: ignore[arg-type]
        for i, seg in enumerate(segments)
    ]
    return "\n".join(blocks)


def render_vtt(segments: list[dict[str, object]]) -> str:
    blocks = [
        f"{_timestamp(float(seg['start']), '.')} --> {_timestamp(float(seg['end']), '.')}\n{seg['text']}\n"  # type: ignore[arg-type]
        for seg in segments
    ]
    return "WEBVTT\n\n" + "\n".join(blocks)


def _language_name(language: str | None, text: str, task: str) -> str:
    """The request's language, else a guess from the script of the text (the model reports none)."""
    if task == "translate":
        return "english"
    if language:
        return language
    return "chinese" if _CJK.search(text) else "english"


async def _handle(
    request: Request,
    task: str,
    file: UploadFile,
    model: str | None,
    language: str | None,
    prompt: str | None,
    response_format: str,
    temperature: float,
    stream: bool,
) -> Response:
    runtime = runtime_of(request)
    check_model(runtime, model)
    if response_format not in RESPONSE_FORMATS:
        raise invalid_request(
            f"response_format must be one of {list(RESPONSE_FORMATS)} (got {response_format!r})",
            "response_format",
        )
    if not 0.0 <= temperature <= 2.0:
        raise invalid_request(f"temperature must be in [0, 2] (got {temperature:g})", "temperature")
    data = await read_upload(file, runtime.config.body_limit)
    samples, rate = await asyncio.to_thread(decode_upload, data, runtime.media_policy.limits)
    audio16 = await asyncio.to_thread(resample, samples, rate, ENCODER_RATE)
    duration = audio16.size / ENCODER_RATE
    if duration < 0.1:
        raise invalid_request(f"the audio lasts {duration * 1000:.0f} ms; at least 100 ms is needed", "file")
    settings = runtime.config.profile.gateway.transcription
    windows = split_windows(audio16, window_s=settings.window_s)
    jobs = [_job(runtime, w, task, language, prompt, temperature) for w in windows]
    require_stages(runtime, ("thinker",))
    runtime.acquire()
    transcript = WindowedTranscript(runtime, jobs, settings.max_parallel_windows)
    pieces = transcript.pieces()

    def segments() -> list[dict[str, object]]:
        return [
            {
                "id": i,
                "seek": int(w.start * 100),
                "start": round(w.start, 3),
                "end": round(w.end, 3),
                "text": transcript.texts[i].strip(),
                "temperature": temperature,
            }
            for i, w in enumerate(windows)
        ]

    def full_text() -> str:
        return " ".join(t.strip() for t in transcript.texts if t.strip())

    if stream:
        first = await first_or_release(pieces, runtime, None)

        async def events() -> AsyncIterator[bytes]:
            def sse(payload: dict[str, object]) -> bytes:
                return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()

            try:
                last = 0
                if first is not None:
                    last = first[0]
                    yield sse({"type": "transcript.text.delta", "delta": first[1]})
                async for index, piece in pieces:
                    if index != last:  # the next window: a space between windows' text
                        piece, last = " " + piece.lstrip(), index
                    yield sse({"type": "transcript.text.delta", "delta": piece})
                usage = {
                    "type": "tokens",
                    "input_tokens": transcript.prompt_tokens,
                    "output_tokens": transcript.completion_tokens,
                    "total_tokens": transcript.prompt_tokens + transcript.completion_tokens,
                }
                yield sse({"type": "transcript.text.done", "text": full_text(), "usage": usage})
            except StageFailure as exc:
                yield sse({"type": "error", **error_body(exc.status, exc.message, exc.param, exc.err_type)})
            finally:
                await pieces.aclose()
                runtime.release()

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    try:
        async for _ in pieces:
            pass
    except StageFailure as exc:
        raise stage_api_error(exc) from exc
    finally:
        await pieces.aclose()
        runtime.release()
    text = full_text()
    if response_format == "text":
        return PlainTextResponse(text + "\n")
    if response_format == "srt":
        return PlainTextResponse(render_srt(segments()))
    if response_format == "vtt":
        return PlainTextResponse(render_vtt(segments()), media_type="text/vtt")
    if response_format == "verbose_json":
        return JSONResponse(
            {
                "task": "translate" if task == "translate" else "transcribe",
                "language": _language_name(language, text, task),
                "duration": round(duration, 3),
                "text": text,
                "segments": segments(),
            }
        )
    usage = {
        "type": "tokens",
        "input_tokens": transcript.prompt_tokens,
        "output_tokens": transcript.completion_tokens,
        "total_tokens": transcript.prompt_tokens + transcript.completion_tokens,
    }
    return JSONResponse({"text": text, "usage": usage})


_FORMAT_DOC = "json, text, srt, vtt or verbose_json (duration, language, timed segments)"
_Prompt = Annotated[
    str | None, Form(max_length=4096, description="context for the transcript, given as a system turn")
]
_Format = Annotated[str, Form(description=_FORMAT_DOC)]
_Temperature = Annotated[float, Form(description="thinker sampling temperature in [0, 2] (0: greedy)")]
_Stream = Annotated[
    bool, Form(description="Server-Sent Events: transcript.text.delta / transcript.text.done")
]
_RESPONSES: dict[int | str, dict[str, object]] = {
    200: {"content": {"application/json": {}, "text/plain": {}, "text/vtt": {}, "text/event-stream": {}}},
    400: {"description": "invalid input (OpenAI error envelope, with param)"},
}


@router.post("/v1/audio/transcriptions", responses=_RESPONSES)
async def create_transcription(
    request: Request,
    file: Annotated[
        UploadFile, File(description="the audio to transcribe (any format PyAV or soundfile reads)")
    ],
    model: Annotated[str | None, Form()] = None,
    language: Annotated[
        str | None, Form(description="ISO-639-1 language of the audio ('zh' picks the Chinese instruction)")
    ] = None,
    prompt: _Prompt = None,
    response_format: _Format = "json",
    temperature: _Temperature = 0.0,
    stream: _Stream = False,
) -> Response:
    """Transcribe speech in its own language."""
    return await _handle(
        request, "transcribe", file, model, language, prompt, response_format, temperature, stream
    )


@router.post("/v1/audio/translations", responses=_RESPONSES)
async def create_translation(
    request: Request,
    file: Annotated[UploadFile, File(description="the audio to translate into English")],
    model: Annotated[str | None, Form()] = None,
    prompt: _Prompt = None,
    response_format: _Format = "json",
    temperature: _Temperature = 0.0,
    stream: _Stream = False,
) -> Response:
    """Translate speech into English text."""
    return await _handle(
        request, "translate", file, model, None, prompt, response_format, temperature, stream
    )
