"""``POST /v1/chat/completions``: request -> :class:`ChatJob` -> pipeline -> JSON or SSE (docs/protocol.md,
Chat request).

Errors before the first output byte are answered with the right HTTP status and the error envelope
(the streaming path waits for the pipeline's first event before sending the 200 headers, so a stage that
is down is a 503, not a 200 stream with an error inside). Errors after that are an SSE ``error`` event
followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway import metrics, tool_calls
from gateway.audio.chat_voice import resolve_chat_voice
from gateway.audio_encoding import encode_audio
from gateway.openai import tools as chat_tools
from gateway.openai.audio_out import OpenAIAudioOut
from gateway.openai.body import read_json_body
from gateway.openai.content import build_thinker_messages, load_ref_audio
from gateway.openai.errors import APIError, api_error_body, error_body
from gateway.openai.logprobs import content_logprobs, logprobs_object
from gateway.openai.openapi_schema import chat_request_openapi
from gateway.openai.protocol import ChatRequest, parse_chat_request
from gateway.pipeline import OUTPUT_SAMPLE_RATE, AudioEvent, ChatJob, FinishEvent, PipelineRun, TextEvent
from gateway.runtime import GatewayRuntime
from gateway.stage_failure import StageFailure
from services.common.audio import resample
from services.common.pb import common_pb2, talker_pb2, thinker_pb2

log = logging.getLogger(__name__)
router = APIRouter()
ROUTE = "/v1/chat/completions"
_HIDDEN_DTYPES = {
    "bfloat16": common_pb2.DTYPE_BFLOAT16,
    "float16": common_pb2.DTYPE_FLOAT16,
    "float32": common_pb2.DTYPE_FLOAT32,
}
DISCONNECT_POLL_S = 0.1  # how often a request still waiting for its first output checks the client
# The handler reads and validates the raw body itself (size limit first, then field-by-field errors), so
# FastAPI cannot infer the body; the schema is declared explicitly for /openapi.json.
_OPENAPI_BODY, OPENAPI_COMPONENTS = chat_request_openapi()


def _runtime(request: Request) -> GatewayRuntime:
    runtime: GatewayRuntime = request.app.state.runtime
    return runtime


def _build_job(
    runtime: GatewayRuntime,
    req: ChatRequest,
    messages: list[thinker_pb2.ChatMessage],
    ref_audio: common_pb2.Pcm | None,
) -> ChatJob:
    profile = runtime.config.profile
    thinker_p = profile.stage("thinker")
    talker_p = profile.stage("talker")
    thinker_s = {**thinker_p.sampling, **req.thinker_sampling}
    talker_s = {**talker_p.sampling, **req.talker_sampling}
    seed = thinker_s.get("seed")
    sampling = thinker_pb2.SamplingParams(**thinker_s)
    # The OpenAI options the thinker implements (validated by gateway.openai.protocol).
    sampling.stop.extend(req.stop)
    sampling.logprobs = req.logprobs
    sampling.top_logprobs = req.top_logprobs or 0
    sampling.presence_penalty = req.presence_penalty
    sampling.frequency_penalty = req.frequency_penalty
    for token, bias in req.logit_bias.items():
        sampling.logit_bias[token] = bias
    grammar = chat_tools.constraint(req)
    if grammar is not None:
        sampling.constraint.CopyFrom(grammar)
    return ChatJob(
        request_id=f"chatcmpl-{uuid.uuid4().hex}",
        messages=messages,
        thinker_sampling=sampling,
        talker_sampling=talker_pb2.TalkerSampling(**talker_s),
        want_speech=req.want_audio,
        use_tts_template=req.use_tts_template,
        enable_thinking=req.enable_thinking,
        ref_audio=ref_audio,
        hidden_chunk_tokens=thinker_p.hidden_chunk_tokens,
        first_hidden_chunk_tokens=thinker_p.first_hidden_chunk_tokens,
        hidden_dtype=_HIDDEN_DTYPES[thinker_p.hidden_dtype],
        window_frames=talker_p.codec.window_frames,
        left_context_frames=talker_p.codec.left_context_frames,
        first_window_frames=talker_p.codec.first_window_frames,
        seed=talker_s.get("seed", seed),
        deadline_s=runtime.config.timeout_s,
        tools_json=chat_tools.tools_json(req),
    )


def _stage_api_error(exc: StageFailure, req: ChatRequest) -> APIError:
    metrics.STAGE_ERRORS.labels(exc.stage, exc.code).inc()
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else None
    param = chat_tools.constraint_param(req) if exc.param == "sampling.constraint" else exc.param
    return APIError(
        exc.status, exc.message, param, exc.err_type, headers, exc.code if exc.client_code else None
    )


def _audio_metadata(fmt: str, frames: int) -> dict[str, Any]:
    return {"format": fmt, "sample_rate_hz": OUTPUT_SAMPLE_RATE, "frame_count": frames, "channels": 1}


def _usage(finish: FinishEvent | None) -> dict[str, Any]:
    """OpenAI's usage object; the two details objects are always present."""
    prompt = finish.prompt_tokens if finish else 0
    completion = finish.completion_tokens if finish else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": finish.cached_tokens if finish else 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def _finish_reason(finish: FinishEvent | None, made_calls: bool) -> str:
    reason = finish.finish_reason if finish else "stop"
    return "tool_calls" if made_calls and reason == "stop" else reason


def _observe(finish: FinishEvent) -> None:
    t = finish.timings
    if "first_text" in t:
        metrics.TTFT.observe(t["first_text"])
    if "first_audio" in t:
        metrics.TTFA.observe(t["first_audio"])
    if "total" in t:
        metrics.E2E.observe(t["total"])
    if finish.audio_samples:
        seconds = finish.audio_samples / OUTPUT_SAMPLE_RATE
        metrics.AUDIO_SECONDS.inc(seconds)
        if "first_speech_chunk" in t and "audio_done" in t:
            metrics.RTF.observe((t["audio_done"] - t["first_speech_chunk"]) / seconds)


def _resample_to_output(event: AudioEvent) -> np.ndarray:
    # Code2wav is specified to produce 24 kHz; anything else is resampled rather than mislabelled.
    return resample(event.samples, event.sample_rate, OUTPUT_SAMPLE_RATE)


@router.post(ROUTE, openapi_extra={"requestBody": _OPENAPI_BODY})
async def create_chat_completion(request: Request) -> Response:
    runtime = _runtime(request)
    body = await read_json_body(request, runtime.config.body_limit)
    max_model_len = runtime.config.profile.stage("thinker").max_model_len
    # Without ``modalities`` the answer is the deploy profile's default output (text only unless set).
    req = parse_chat_request(
        body, runtime.config.model_name, max_model_len, runtime.config.profile.gateway.default_modalities
    )
    runtime.acquire()
    released = False
    try:
        messages = await build_thinker_messages(req.messages, runtime.media_policy)
        ref = await load_ref_audio(req.ref_audio, runtime.media_policy) if req.ref_audio else None
        named = req.openai_audio.voice if req.openai_audio is not None else None
        voice = resolve_chat_voice(request, named) if req.want_audio else None
        job = _build_job(runtime, req, messages, ref)
        if voice is not None and ref is None:  # a registered voice: the stages' stored features
            job.thinker_voice, job.voice_prompt = voice.thinker, voice.code2wav
        try:  # a stage known down: 503 + Retry-After now (after input checks), not an SSE error after a 200
            runtime.monitor.require(("thinker", "talker", "code2wav") if req.want_audio else ("thinker",))
        except StageFailure as exc:
            raise _stage_api_error(exc, req) from exc
        run = runtime.pipeline.start(job)
        if req.stream:
            response = await _start_stream(request, runtime, req, job, run)
            released = True  # the stream's generator releases the slot
            return response
        return await _complete(request, req, job, run)
    finally:
        if not released:
            runtime.release()


# ---- non-streaming --------------------------------------------------------------------------------
async def _collect(
    req: ChatRequest, run: PipelineRun
) -> tuple[list[str], list[np.ndarray], FinishEvent | None, list[thinker_pb2.TokenLogprob]]:
    texts: list[str] = []
    audio: list[np.ndarray] = []
    logprobs: list[thinker_pb2.TokenLogprob] = []
    finish: FinishEvent | None = None
    async for event in run.events():
        if isinstance(event, TextEvent):
            texts.append(event.text)
            logprobs.extend(event.logprobs)
        elif isinstance(event, AudioEvent):
            audio.append(_resample_to_output(event))
        else:
            finish = event
    return texts, audio, finish, logprobs


async def _complete(request: Request, req: ChatRequest, job: ChatJob, run: PipelineRun) -> Response:
    task = asyncio.create_task(_collect(req, run))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await request.is_disconnected():
                metrics.CLIENT_DISCONNECTS.inc()
                run.abort()
                task.cancel()
                return Response(status_code=499)
        texts, audio, finish, token_logprobs = task.result()
    except StageFailure as exc:
        raise _stage_api_error(exc, req) from exc
    finally:
        run.abort()
        if not task.done():
            task.cancel()
    created = int(time.time())
    text = "".join(texts)
    calls: list[tool_calls.ParsedCall] = []
    if chat_tools.parses_tool_calls(req):
        text, calls = tool_calls.parse_all(text)
    openai_audio = req.openai_audio is not None and req.want_audio
    message: dict[str, Any] = {
        "role": "assistant",
        "content": text if (req.want_text and not openai_audio and (text or not calls)) else None,
        "refusal": None,
    }
    if calls:
        message["tool_calls"] = [c.as_openai() for c in calls]
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": logprobs_object(token_logprobs) if req.logprobs else None,
        "finish_reason": _finish_reason(finish, bool(calls)),
    }
    if openai_audio:
        assert req.openai_audio is not None
        if not audio:
            raise APIError(400, "Audio generation completed but no audio was produced.", None)
        samples = np.concatenate(audio)
        message["audio"] = OpenAIAudioOut(req.openai_audio.format).message(samples, text)
        choice["audio_metadata"] = _audio_metadata(req.audio_format, int(samples.size))
    elif req.want_audio:
        if not audio:
            raise APIError(400, "Audio generation completed but no audio was produced.", None)
        samples = np.concatenate(audio)
        message["audio"] = {
            "id": f"audio-{secrets.token_hex(8)}",
            "data": base64.b64encode(encode_audio(samples, OUTPUT_SAMPLE_RATE, req.audio_format)).decode(),
            "expires_at": created + 24 * 3600,
            "transcript": "",
        }
        choice["audio_metadata"] = _audio_metadata(req.audio_format, int(samples.size))
    if finish is not None:
        _observe(finish)
    return JSONResponse(
        {
            "id": job.request_id,
            "object": "chat.completion",
            "created": created,
            "model": req.model,
            "choices": [choice],
            "system_fingerprint": None,
            "usage": _usage(finish),
            "metrics": finish.timings if (finish and req.return_stage_metrics) else None,
        }
    )


# ---- streaming ------------------------------------------------------------------------------------
def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _start_stream(
    request: Request, runtime: GatewayRuntime, req: ChatRequest, job: ChatJob, run: PipelineRun
) -> Response:
    events = run.events()
    # The 200 waits for the first event (a stage that is down is a 503, not an SSE error), but the client
    # is watched meanwhile: one that leaves during prefill cancels the stages now, not after prefill.
    waiting = asyncio.ensure_future(events.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await request.is_disconnected():
                metrics.CLIENT_DISCONNECTS.inc()
                run.abort()
                waiting.cancel()
                return Response(status_code=499)
        first = waiting.result()
    except StageFailure as exc:
        run.abort()
        raise _stage_api_error(exc, req) from exc
    except BaseException:
        run.abort()
        waiting.cancel()
        raise
    return StreamingResponse(
        _stream_body(runtime, req, job, run, first, events),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


class _Chunks:
    """Builds the SSE chunks of one streamed completion: the role on the first, usage where asked."""

    def __init__(self, req: ChatRequest, request_id: str, first: Any) -> None:
        self.req = req
        self.base = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": req.model,
        }
        self.role_sent = False
        # stream_options.continuous_usage_stats (vLLM extension): every chunk carries the usage so far.
        # The thinker repeats the prompt length on each TextDelta, so it is known from the first chunk on.
        self.prompt_tokens = first.prompt_tokens if isinstance(first, TextEvent) else 0
        self.completion_tokens = 0
        self.cached_tokens = 0  # known with the thinker's Done

    def count(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens or self.prompt_tokens
        self.completion_tokens = max(self.completion_tokens, completion_tokens)

    def chunk(self, modality: str, delta: dict[str, Any], **extra: Any) -> str:
        if not self.role_sent:
            delta = {"role": "assistant", **delta}
            self.role_sent = True
        body: dict[str, Any] = {
            **self.base,
            "modality": modality,
            "choices": [{"index": 0, "delta": delta, **extra}],
        }
        if self.req.continuous_usage_stats:
            body["usage"] = {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            }
        return _sse(body)


async def _stream_body(
    runtime: GatewayRuntime,
    req: ChatRequest,
    job: ChatJob,
    run: PipelineRun,
    first: Any,
    events: AsyncIterator[Any],
) -> AsyncIterator[str]:
    out = _Chunks(req, job.request_id, first)
    chunk = out.chunk
    # OpenAI's audio dialect when the body carries the ``audio`` object, else vLLM-Omni's (audio_out.py).
    openai_audio = OpenAIAudioOut(req.openai_audio.format) if req.openai_audio and req.want_audio else None
    parser = tool_calls.ToolCallParser() if chat_tools.parses_tool_calls(req) else None
    produced_audio = False
    finished_normally = False

    async def all_events() -> AsyncIterator[Any]:
        yield first
        async for ev in events:
            yield ev

    def text_chunks(text: str, logprobs: list[Any]) -> list[str]:
        """The chunks of one text delta: content (or transcript), tool-call fragments, logprobs."""
        extra: dict[str, Any] = {}
        if req.logprobs:
            extra["logprobs"] = {"content": content_logprobs(logprobs), "refusal": None}
        calls: list[dict[str, Any]] = []
        if parser is not None:
            text, calls = parser.feed(text)
        chunks = []
        if openai_audio is not None and text:
            chunks.append(chunk("text", {"audio": openai_audio.transcript_delta(text)}, **extra))
        elif req.want_text and (text or extra):
            chunks.append(chunk("text", {"content": text}, **extra))
        if calls:
            chunks.append(chunk("text", {"tool_calls": calls}))
        return chunks

    try:
        if openai_audio is not None:
            yield chunk("text", {})  # the role alone; the words come as delta.audio.transcript
        elif req.want_text:
            yield chunk("text", {"content": ""})
        async for event in all_events():
            if isinstance(event, TextEvent):
                out.count(event.prompt_tokens, event.completion_tokens)
                for piece in text_chunks(event.text, event.logprobs):
                    yield piece
            elif isinstance(event, AudioEvent):
                samples = _resample_to_output(event)
                produced_audio = True
                if openai_audio is not None:
                    yield chunk("audio", {"audio": openai_audio.data_delta(samples)})
                    continue
                payload = base64.b64encode(
                    encode_audio(samples, OUTPUT_SAMPLE_RATE, req.audio_format)
                ).decode()
                yield chunk(
                    "audio",
                    {"content": payload},
                    audio_metadata=_audio_metadata(req.audio_format, int(samples.size)),
                )
            elif isinstance(event, FinishEvent):
                if req.want_audio and not produced_audio:
                    yield _sse(error_body(400, "Audio generation completed but no audio was produced."))
                    break
                if parser is not None:
                    tail, calls = parser.finish()
                    if tail and req.want_text:
                        yield chunk("text", {"content": tail})
                    if calls:
                        yield chunk("text", {"tool_calls": calls})
                _observe(event)
                out.prompt_tokens, out.completion_tokens = event.prompt_tokens, event.completion_tokens
                out.cached_tokens = event.cached_tokens
                last_modality = "audio" if req.want_audio else "text"
                made_calls = parser is not None and bool(parser.calls)
                yield chunk(last_modality, {}, finish_reason=_finish_reason(event, made_calls))
                if req.include_usage:
                    yield _sse({**out.base, "modality": last_modality, "choices": [], "usage": _usage(event)})
                finished_normally = True
        yield "data: [DONE]\n\n"
    except StageFailure as exc:
        yield _sse(api_error_body(_stage_api_error(exc, req)))
        yield "data: [DONE]\n\n"
    except APIError as exc:
        yield _sse(api_error_body(exc))
        yield "data: [DONE]\n\n"
    except (GeneratorExit, asyncio.CancelledError):
        if not finished_normally:
            metrics.CLIENT_DISCONNECTS.inc()
        raise
    finally:
        run.abort()
        runtime.release()
