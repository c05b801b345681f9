"""One speaking turn of a duplex session: a talker stream and a code2wav stream, and the pumps between them.

The thinker's ``SpeechChunk`` hidden states of the turn go to the talker (``TalkerOpen(mode=DUPLEX)``),
its codec windows to code2wav, and the 24 kHz audio back to the session as :class:`AudioOut`. A turn is
opened by :class:`gateway.realtime.pipeline.duplex.GrpcDuplexPipeline` and reports to it through two
callbacks (failed, finished) and to the session through ``report``; it never sees the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from gateway.realtime import metrics
from gateway.realtime.audio import resample
from gateway.realtime.pipeline.events import AudioOut, PipelineEvent, StageAck
from gateway.realtime.settings import RealtimeSettings
from gateway.stage_clients import StageSet
from gateway.stage_failure import StageFailure
from gateway.stage_stream_client import StageStream
from services.common.pb import code2wav_pb2, common_pb2, talker_pb2, thinker_pb2
from services.common.pcm import pcm_to_float

_STAGE_ERROR_CODES = {
    common_pb2.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED: "context_length_exceeded",
    common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED: "resource_exhausted",
    common_pb2.ERROR_CODE_UNAVAILABLE: "stage_unavailable",
}
_ACK_WAIT_S = 5.0

FailureCallback = Callable[["SpeechTurn", str, str, str], None]  # (turn, stage, code, message)


def stage_error_code(err: common_pb2.Error) -> str:
    """The realtime error code of an ``Error`` a stage sent in its stream."""
    return _STAGE_ERROR_CODES.get(err.code, "engine_error")


def failure_code(exc: BaseException) -> tuple[str, str]:
    """The stable realtime error code and message of an exception a stage call raised."""
    if isinstance(exc, StageFailure):
        code = exc.code
        if code in ("unavailable", "stage_unavailable"):
            code = "stage_unavailable"
        elif code not in ("context_length_exceeded", "resource_exhausted", "invalid_argument"):
            code = "engine_error"
        return code, str(exc)
    return "engine_error", f"{type(exc).__name__}: {exc}"


class SpeechTurn:
    """Talker + code2wav streams of one speaking turn (both opened on construction, started by :meth:`start`)."""

    def __init__(
        self,
        *,
        session_id: str,
        epoch: int,
        turn_id: int,
        stages: StageSet,
        settings: RealtimeSettings,
        ref_pcm: common_pb2.Pcm | None,
        voice_prompt: code2wav_pb2.VoicePrompt | None = None,
        report: Callable[[PipelineEvent], None],
        on_failure: FailureCallback,
        on_finished: Callable[[SpeechTurn], None],
    ) -> None:
        self.session_id = session_id
        self.epoch = epoch  # the epoch this turn speaks for (a stamp: the session owns the current one)
        self.turn_id = turn_id
        self.settings = settings
        self.ref_pcm = ref_pcm
        self.voice_prompt = voice_prompt  # a registered voice: code2wav's stored features
        self.talker: StageStream = stages["talker"].open_stream(deadline_s=3600.0)
        self.code2wav: StageStream = stages["code2wav"].open_stream(deadline_s=3600.0)
        self._report = report
        self._on_failure = on_failure
        self._on_finished = on_finished
        self.tasks: list[asyncio.Task[None]] = []
        self.talker_chunk_seq = 1
        self.ending = False
        self.finished = False
        self.interrupted = False
        self.failed = False  # a stream of this turn failed (reported once); its streams are cancelled
        self.acked: set[str] = set()
        self.all_acked = asyncio.Event()
        self._interrupt_sent = 0.0
        self.request_started: float | None = None  # turn lane: its response's request (first-audio phases)

    def _first(self, phase: str) -> None:
        if self.request_started is not None:
            metrics.FIRST_AUDIO_PHASE.labels(phase).observe(time.monotonic() - self.request_started)

    # ---------------------------------------------------------------- opening and input

    async def start(self) -> bool:
        """Send both Open messages and start the pumps; False (failure reported) if either stage refuses."""
        open_id = common_pb2.Identity(
            request_id=self.session_id, session_id=self.session_id, epoch=self.epoch, turn_id=self.turn_id
        )
        tsampling = talker_pb2.TalkerSampling()
        c2w_open = code2wav_pb2.Code2WavOpen(id=open_id, output_format=common_pb2.PCM_FORMAT_S16LE)
        if self.settings.seed is not None:
            tsampling.seed = self.settings.seed
            c2w_open.seed = self.settings.seed
        if self.voice_prompt is not None:
            c2w_open.voice.CopyFrom(self.voice_prompt)
        elif self.ref_pcm is not None:
            c2w_open.ref_audio.CopyFrom(self.ref_pcm)
        talker_open = talker_pb2.TalkerOpen(
            id=open_id,
            mode=common_pb2.STREAM_MODE_DUPLEX,
            sampling=tsampling,
            first_window_frames=self.settings.first_window_frames,
        )
        stage = "talker"
        try:
            await self.talker.write(talker_pb2.TalkerRequest(open=talker_open))
            stage = "code2wav"
            await self.code2wav.write(code2wav_pb2.Code2WavRequest(open=c2w_open))
        except asyncio.CancelledError:
            self.cancel()
            raise
        except BaseException as exc:  # noqa: BLE001 - reported to the session, never raised into the reader
            self.fail(stage, exc)
            return False
        self.tasks.append(asyncio.create_task(self._talker_pump()))
        self.tasks.append(asyncio.create_task(self._code2wav_pump()))
        return True

    async def send_speech(self, chunk: thinker_pb2.SpeechChunk) -> None:
        """Forward one thinker speech chunk (hidden states + tokens) to the talker."""
        talker_chunk = talker_pb2.TalkerChunk(
            id=common_pb2.Identity(
                request_id=self.session_id,
                session_id=self.session_id,
                epoch=chunk.id.epoch,
                turn_id=self.turn_id,
                unit_seq=chunk.id.unit_seq,
                chunk_seq=self.talker_chunk_seq,
            ),
            token_ids=chunk.token_ids,
            hidden=chunk.hidden,
            turn_end=chunk.turn_end,
            is_last=False,
        )
        self.talker_chunk_seq += 1
        try:
            await self.talker.write(talker_pb2.TalkerRequest(chunk=talker_chunk))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001
            self.fail("talker", exc)

    def end_input(self) -> Coroutine[Any, Any, None] | None:
        """No more speech for this turn: the coroutine that ends the talker input (None if already ending)."""
        if self.ending:
            return None
        self.ending = True
        return self._end_talker_input()

    async def _end_talker_input(self) -> None:
        """End the talker, which closes the turn and answers Done."""
        try:
            end = common_pb2.Control(
                id=common_pb2.Identity(epoch=self.epoch, turn_id=self.turn_id), end=common_pb2.End()
            )
            await self.talker.write(talker_pb2.TalkerRequest(control=end))
            await self.talker.done_writing()
        except BaseException as exc:  # noqa: BLE001
            if not self.interrupted:
                self.fail("talker", exc)

    # ---------------------------------------------------------------- pumps

    def _control(
        self, stage: str, kind: str | None, resp: talker_pb2.TalkerResponse | code2wav_pb2.Code2WavResponse
    ) -> str:
        """The replies both streams of a turn share: an ack is noted (``"next"``), an error reported
        unless the turn is being fenced (``"error"``: the pump ends), Done ends the input (``"done"``)."""
        if kind == "interrupt_ack":
            self._on_ack(stage, resp.interrupt_ack)
        elif kind == "error":
            if not self.interrupted:
                self.fail(stage, None, stage_error_code(resp.error), f"{stage}: {resp.error.message}")
            return "error"
        elif kind == "done":
            return "done"
        return "next"

    def _on_ack(self, stage: str, ack: common_pb2.InterruptAck) -> None:
        self.acked.add(stage)
        if {"talker", "code2wav"} <= self.acked:
            self.all_acked.set()
        metrics.BARGE_IN_STAGE.labels(stage).observe(time.monotonic() - self._interrupt_sent)
        self._report(StageAck(stage, int(ack.new_epoch), int(ack.dropped_items)))

    async def _talker_pump(self) -> None:
        """Talker windows → code2wav (renumbered from 0); acks and errors reported; End/close after Done."""
        last_sent = False
        seq = 0  # code2wav numbers windows from 0 (the open message is not counted)
        try:
            async for resp in self.talker.responses():
                kind = resp.WhichOneof("kind")
                if kind == "window":
                    if resp.window.id.epoch < self.epoch or self.interrupted:
                        continue
                    window = common_pb2.CodecWindow()
                    window.CopyFrom(resp.window)
                    window.id.chunk_seq = seq
                    if seq == 0:
                        self._first("window")
                    seq += 1
                    await self.code2wav.write(code2wav_pb2.Code2WavRequest(window=window))
                    last_sent = last_sent or window.is_last
                    continue
                step = self._control("talker", kind, resp)
                if step == "error":
                    return
                if step == "done":
                    break
            if self.interrupted:
                return
            if not last_sent:
                end = common_pb2.Control(id=common_pb2.Identity(epoch=self.epoch), end=common_pb2.End())
                await self.code2wav.write(code2wav_pb2.Code2WavRequest(control=end))
            await self.code2wav.done_writing()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001
            if not self.interrupted:
                self.fail("talker", exc)

    async def _code2wav_pump(self) -> None:
        """code2wav audio → the session as :class:`AudioOut` (an empty last one if the stage sent none)."""
        sent_last = False
        try:
            async for resp in self.code2wav.responses():
                kind = resp.WhichOneof("kind")
                if kind == "audio":
                    if resp.audio.id.epoch < self.epoch or self.interrupted or sent_last:
                        continue
                    samples, rate = pcm_to_float(resp.audio.pcm)
                    if rate != 24_000 and samples.size:
                        samples = resample(samples, rate, 24_000)
                    sent_last = bool(resp.audio.is_last)
                    if samples.size:
                        self._first("audio")
                        self.request_started = None
                    self._report(AudioOut(self.epoch, samples, sent_last, self.turn_id))
                    continue
                step = self._control("code2wav", kind, resp)
                if step == "error":
                    return
                if step == "done":
                    break
            if not self.interrupted and not self.failed and not sent_last:
                self._report(AudioOut(self.epoch, np.zeros(0, dtype=np.float32), True, self.turn_id))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001
            if not self.interrupted:
                self.fail("code2wav", exc)
        finally:
            self.cancel()

    # ---------------------------------------------------------------- interrupt, failure, close

    def interrupt(self, new_epoch: int, reason: str) -> Coroutine[Any, Any, None] | None:
        """Mark the turn interrupted now; the coroutine fences its streams (None if already done or fenced)."""
        if self.finished or self.interrupted:
            return None
        self.interrupted = True
        self._interrupt_sent = time.monotonic()
        return self._fence(new_epoch, reason)

    async def _fence(self, new_epoch: int, reason: str) -> None:
        """Send the interrupt to the talker and code2wav, wait (bounded) for their acks, then close them."""
        ctl = common_pb2.Control(
            id=common_pb2.Identity(request_id=self.session_id, session_id=self.session_id, epoch=new_epoch),
            interrupt=common_pb2.Interrupt(new_epoch=new_epoch, reason=reason),
        )
        with contextlib.suppress(BaseException):
            await self.talker.write(talker_pb2.TalkerRequest(control=ctl))
        with contextlib.suppress(BaseException):
            await self.code2wav.write(code2wav_pb2.Code2WavRequest(control=ctl))
        # The pumps keep reading and report the acks; give them a bounded time before closing.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.all_acked.wait(), _ACK_WAIT_S)
        self.cancel()

    def fail(self, stage: str, exc: BaseException | None, code: str = "", message: str = "") -> None:
        """A stream of this turn failed: cancel both streams (the survivor would otherwise wait for input
        that never comes) and report the failure once, through the pipeline."""
        if self.failed or self.interrupted or self.finished:
            return  # already reported, fenced by an interrupt, or done (its audio is all delivered)
        self.failed = True
        self.cancel()
        if exc is not None:
            code, message = failure_code(exc)
        self._on_failure(self, stage, code, message)

    def cancel(self) -> None:
        """Close the turn: cancel its pumps (not the calling one) and both RPCs; tell the pipeline once."""
        was_finished, self.finished = self.finished, True
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:  # a pump failing its own turn returns on its own
                task.cancel()
        self.talker.cancel()
        self.code2wav.cancel()
        if not was_finished:
            self._on_finished(self)
