"""The turn-mode orchestrator: one chat request through thinker -> talker -> code2wav.

For each request it opens one bidi stream per stage and runs three pumps:

* thinker pump: ``TextDelta`` -> client text; ``SpeechChunk`` -> talker ``TalkerChunk``. The talker and
  code2wav streams are opened on the FIRST speech chunk, so speech starts while the thinker is still
  writing text;
* talker pump: ``CodecWindow`` -> code2wav (the window already carries its left context);
* code2wav pump: ``AudioChunk`` -> client audio.

Backpressure: gRPC flow control bounds each stage stream, and the events for the client go through a
bounded queue; a slow client therefore stops the code2wav pump, which stops reading code2wav, which stops
the talker pump, and so on up to the thinker.

Identity: every message carries the request's ``Identity`` (request_id, epoch 0, turn_id 0) with a
``chunk_seq`` counted from 0 per stream direction over the data messages (chunks, windows); the open
message carries 0 as well.

Cancellation: leaving the event iterator early (client disconnect, error, deadline) cancels every pump
and every stage call; each stage sees CANCELLED and frees the stream's KV cache / budgets / vocoder state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import numpy as np

from gateway.stage_clients import StageSet
from gateway.stage_failure import StageFailure
from gateway.stage_stream_client import StageStream
from services.common.pb import code2wav_pb2, common_pb2, talker_pb2, thinker_pb2
from services.common.pcm import pcm_to_float

log = logging.getLogger(__name__)

OUTPUT_QUEUE_DEPTH = 16
OUTPUT_SAMPLE_RATE = 24_000


@dataclass
class ChatJob:
    """Everything the stages need for one chat turn, already validated and converted to protos."""

    request_id: str
    messages: list[thinker_pb2.ChatMessage]
    thinker_sampling: thinker_pb2.SamplingParams
    talker_sampling: talker_pb2.TalkerSampling
    want_speech: bool
    use_tts_template: bool
    enable_thinking: bool
    ref_audio: common_pb2.Pcm | None = None
    hidden_chunk_tokens: int = 10
    first_hidden_chunk_tokens: int = 11
    hidden_dtype: common_pb2.DType = common_pb2.DTYPE_BFLOAT16
    window_frames: int = 25
    left_context_frames: int = 3
    first_window_frames: int = 25
    seed: int | None = None
    deadline_s: float = 600.0
    # Function tools for the chat template (one JSON signature each; gateway.openai.tools).
    tools_json: list[str] = field(default_factory=list)
    # /v1/audio/speech: the spoken reply is exactly this text (the thinker is teacher-forced over it).
    teacher_text: str | None = None
    # A registered voice's stored features, sent instead of ref_audio: the thinker's audio-encoder rows
    # for its speech system prompt and code2wav's prompt.
    thinker_voice: thinker_pb2.VoiceEmbedding | None = None
    voice_prompt: code2wav_pb2.VoicePrompt | None = None


@dataclass
class TextEvent:
    text: str
    token_count: int
    # Running usage when this text left the thinker (for stream_options.continuous_usage_stats):
    # the prompt length the thinker reported and the tokens generated so far, this delta included.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Per-token log-probabilities of this delta's tokens (when the request asked for them).
    logprobs: list[thinker_pb2.TokenLogprob] = field(default_factory=list)


@dataclass
class AudioEvent:
    samples: np.ndarray  # float32 mono in [-1, 1]
    sample_rate: int


@dataclass
class FinishEvent:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    audio_samples: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    cached_tokens: int = 0  # prompt tokens the thinker found in its prefix cache


PipelineEvent = TextEvent | AudioEvent | FinishEvent


class _Sequencer:
    """Stamps the request identity with a per-stream ``chunk_seq``."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._next = 0

    def next(self) -> common_pb2.Identity:
        ident = common_pb2.Identity(request_id=self.request_id, epoch=0, turn_id=0, chunk_seq=self._next)
        self._next += 1
        return ident


class ChatPipeline:
    """Runs :class:`ChatJob`s against a :class:`StageSet`; stateless between requests."""

    def __init__(self, stages: StageSet) -> None:
        self.stages = stages
        self.live: set[PipelineRun] = set()  # runs not yet finished or aborted (the drain ends them)

    def start(self, job: ChatJob) -> PipelineRun:
        """A run whose :meth:`PipelineRun.events` drives the stages; call ``abort()`` when abandoning it."""
        run = PipelineRun(self.stages, job, self.live.discard)
        self.live.add(run)
        return run

    def end_all(self, exc: BaseException) -> int:
        """Make every live run's consumer see ``exc`` next (the drain's grace ran out); returns how many."""
        runs = list(self.live)
        for run in runs:
            run.end_with(exc)
        return len(runs)


class PipelineRun:
    def __init__(
        self, stages: StageSet, job: ChatJob, on_done: Callable[[PipelineRun], None] | None = None
    ) -> None:
        self.stages = stages
        self.job = job
        self._on_done = on_done
        self.queue: asyncio.Queue[PipelineEvent | BaseException | None] = asyncio.Queue(OUTPUT_QUEUE_DEPTH)
        self.streams: dict[str, StageStream] = {}
        self.tasks: list[asyncio.Task[None]] = []
        self.started = time.monotonic()
        self.timings: dict[str, float] = {}
        self.thinker_done: common_pb2.Done | None = None
        self.audio_samples = 0
        self.audio_finished = asyncio.Event()
        self.saw_text_delta = False
        self.prompt_tokens = 0  # as reported on the thinker's TextDeltas (0 until it says)
        self.completion_tokens = 0  # token ids seen on TextDeltas so far

    # ---- lifecycle -------------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[PipelineEvent]:
        try:
            self.tasks.append(
                asyncio.create_task(self._thinker_pump(), name=f"{self.job.request_id}:thinker")
            )
            while True:
                item = await self.queue.get()
                if item is None:
                    # Normal end: let every stage end its stream itself (no cancel races on its side).
                    await asyncio.gather(*(stream.finish() for stream in self.streams.values()))
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
            yield self._finish_event()
        finally:
            await self._shutdown()

    def abort(self) -> None:
        """Cancel every stage call and pump now (synchronous, so it works inside a cancelled scope)."""
        if self._on_done is not None:
            self._on_done(self)
        for stream in self.streams.values():
            stream.cancel()
        for task in self.tasks:
            task.cancel()

    async def _shutdown(self) -> None:
        """Cancel every pump and stage call; safe whether the run finished, failed or was abandoned."""
        self.abort()
        for task in self.tasks:
            with contextlib.suppress(BaseException):
                await task

    def end_with(self, exc: BaseException) -> None:
        """End the run from outside: queued output is dropped and the consumer gets ``exc`` next (then the
        run shuts down as after any failure). A pump blocked on the full queue may add one more item, but
        only behind ``exc``."""
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(exc)

    async def _fail(self, exc: BaseException) -> None:
        # Put the failure at the front of what the consumer sees next; drop queued output.
        while not self.queue.empty():
            self.queue.get_nowait()
        await self.queue.put(exc)

    def _mark(self, name: str) -> None:
        self.timings.setdefault(name, time.monotonic() - self.started)

    def _finish_event(self) -> FinishEvent:
        done = self.thinker_done
        reason = done.finish_reason if done is not None and done.finish_reason else "stop"
        usage = done.usage if done is not None else common_pb2.Usage()
        self.timings["total"] = time.monotonic() - self.started
        return FinishEvent(
            finish_reason=reason,
            prompt_tokens=int(usage.prompt_tokens),
            completion_tokens=int(usage.completion_tokens),
            audio_samples=self.audio_samples,
            timings=dict(self.timings),
            cached_tokens=int(usage.cached_tokens),
        )

    def _text_event(self, text: str, token_count: int) -> TextEvent:
        return TextEvent(text, token_count, self.prompt_tokens, self.completion_tokens)

    # ---- thinker --------------------------------------------------------------------------------
    def _thinker_open(self, seq: _Sequencer) -> thinker_pb2.ThinkerRequest:
        job = self.job
        open_msg = thinker_pb2.ThinkerOpen(
            id=seq.next(),
            mode=common_pb2.STREAM_MODE_TURN,
            messages=job.messages,
            sampling=job.thinker_sampling,
            use_tts_template=job.use_tts_template,
            enable_thinking=job.enable_thinking,
            want_speech=job.want_speech,
            chunk_tokens=job.hidden_chunk_tokens,
            first_chunk_tokens=job.first_hidden_chunk_tokens,
            hidden_dtype=job.hidden_dtype,
            tools_json=job.tools_json,
        )
        if job.thinker_voice is not None:
            open_msg.voice.CopyFrom(job.thinker_voice)
        elif job.ref_audio is not None:
            open_msg.ref_audio.CopyFrom(job.ref_audio)
        if job.teacher_text:
            open_msg.teacher_text = job.teacher_text
        return thinker_pb2.ThinkerRequest(open=open_msg)

    async def _thinker_pump(self) -> None:
        try:
            thinker = self.stages["thinker"].open_stream(self.job.deadline_s)
            self.streams["thinker"] = thinker
            out_seq = _Sequencer(self.job.request_id)
            await thinker.write(self._thinker_open(out_seq))
            await thinker.done_writing()
            talker_seq = _Sequencer(self.job.request_id)
            last_sent = False
            speech_text: list[str] = []
            async for resp in thinker.responses():
                kind = resp.WhichOneof("kind")
                if kind == "text":
                    self._mark("first_text")
                    self.saw_text_delta = True
                    self.prompt_tokens = resp.text.prompt_tokens or self.prompt_tokens
                    self.completion_tokens += len(resp.text.token_ids)
                    if resp.text.text or resp.text.logprobs:
                        event = self._text_event(resp.text.text, len(resp.text.token_ids))
                        event.logprobs = list(resp.text.logprobs)
                        await self.queue.put(event)
                elif kind == "speech":
                    chunk = resp.speech
                    if not self.job.want_speech:
                        continue
                    if "talker" not in self.streams:
                        self._mark("first_speech_chunk")
                        await self._start_speech()
                    if chunk.text:
                        speech_text.append(chunk.text)
                    await self.streams["talker"].write(
                        talker_pb2.TalkerRequest(
                            chunk=talker_pb2.TalkerChunk(
                                id=talker_seq.next(),
                                token_ids=chunk.token_ids,
                                hidden=chunk.hidden,
                                turn_end=chunk.turn_end,
                                is_last=chunk.is_last,
                            )
                        )
                    )
                    last_sent = chunk.is_last
                elif kind == "done":
                    self.thinker_done = resp.done
                    break
                elif kind == "error":
                    raise StageFailure.from_stage_error("thinker", resp.error)
            if self.thinker_done is None:
                raise StageFailure(
                    "thinker", 502, "thinker stream ended without Done", "stage_closed", "BadGatewayError"
                )
            self._mark("thinker_done")
            if not self.saw_text_delta and speech_text:
                # A thinker that reports the spoken text only inside SpeechChunks still yields text.
                await self.queue.put(self._text_event("".join(speech_text), 0))
            if "talker" in self.streams:
                talker = self.streams["talker"]
                if not last_sent:
                    end = common_pb2.Control(id=talker_seq.next(), end=common_pb2.End())
                    await talker.write(talker_pb2.TalkerRequest(control=end))
                await talker.done_writing()
                await self.audio_finished.wait()
            await self.queue.put(None)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - every failure goes to the consumer
            await self._fail(exc)

    # ---- talker + code2wav ----------------------------------------------------------------------
    async def _start_speech(self) -> None:
        job = self.job
        talker = self.stages["talker"].open_stream(job.deadline_s)
        code2wav = self.stages["code2wav"].open_stream(job.deadline_s)
        self.streams["talker"] = talker
        self.streams["code2wav"] = code2wav
        open_id = common_pb2.Identity(request_id=job.request_id, chunk_seq=0)
        talker_open = talker_pb2.TalkerOpen(
            id=open_id,
            mode=common_pb2.STREAM_MODE_TURN,
            sampling=job.talker_sampling,
            window_frames=job.window_frames,
            left_context=job.left_context_frames,
            first_window_frames=job.first_window_frames,
        )
        c2w_open = code2wav_pb2.Code2WavOpen(id=open_id, output_format=common_pb2.PCM_FORMAT_S16LE)
        if job.seed is not None:
            c2w_open.seed = job.seed
        if job.voice_prompt is not None:
            c2w_open.voice.CopyFrom(job.voice_prompt)
        elif job.ref_audio is not None:
            c2w_open.ref_audio.CopyFrom(job.ref_audio)
        await talker.write(talker_pb2.TalkerRequest(open=talker_open))
        await code2wav.write(code2wav_pb2.Code2WavRequest(open=c2w_open))
        self.tasks.append(asyncio.create_task(self._talker_pump(), name=f"{job.request_id}:talker"))
        self.tasks.append(asyncio.create_task(self._code2wav_pump(), name=f"{job.request_id}:code2wav"))

    async def _talker_pump(self) -> None:
        try:
            talker = self.streams["talker"]
            code2wav = self.streams["code2wav"]
            seq = _Sequencer(self.job.request_id)  # windows count from 0, as code2wav checks
            last_sent = False
            done = False
            async for resp in talker.responses():
                kind = resp.WhichOneof("kind")
                if kind == "window":
                    self._mark("first_codec_window")
                    window = common_pb2.CodecWindow()
                    window.CopyFrom(resp.window)
                    window.id.CopyFrom(seq.next())
                    await code2wav.write(code2wav_pb2.Code2WavRequest(window=window))
                    last_sent = window.is_last
                elif kind == "done":
                    done = True
                    break
                elif kind == "error":
                    raise StageFailure.from_stage_error("talker", resp.error)
            if not done:
                raise StageFailure(
                    "talker", 502, "talker stream ended without Done", "stage_closed", "BadGatewayError"
                )
            if not last_sent:
                end = common_pb2.Control(id=seq.next(), end=common_pb2.End())
                await code2wav.write(code2wav_pb2.Code2WavRequest(control=end))
            await code2wav.done_writing()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001
            await self._fail(exc)

    async def _code2wav_pump(self) -> None:
        try:
            code2wav = self.streams["code2wav"]
            done = False
            async for resp in code2wav.responses():
                kind = resp.WhichOneof("kind")
                if kind == "audio":
                    samples, rate = pcm_to_float(resp.audio.pcm)
                    if samples.size:
                        self._mark("first_audio")
                        self.audio_samples += int(samples.size)
                        await self.queue.put(AudioEvent(samples, rate))
                elif kind == "done":
                    done = True
                    break
                elif kind == "error":
                    raise StageFailure.from_stage_error("code2wav", resp.error)
            if not done:
                raise StageFailure(
                    "code2wav", 502, "code2wav stream ended without Done", "stage_closed", "BadGatewayError"
                )
            self._mark("audio_done")
            self.audio_finished.set()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001
            await self._fail(exc)
