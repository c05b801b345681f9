"""Stage plumbing of one duplex session: one thinker duplex stream, talker + code2wav per speaking turn.

The session (``gateway.realtime.session``) decides *what* to send; this module moves messages between
the stages and reports back through the session's mailbox:

* units go to the thinker's duplex stream (opened lazily on the first unit, so a session that never
  sends audio never touches a stage);
* the thinker's ``SpeechChunk`` hidden states of a speaking turn go to a talker stream opened for that
  turn (``TalkerOpen(mode=DUPLEX)``), its codec windows to a code2wav stream of the same turn, and the
  24 kHz audio back to the session as :class:`AudioOut`;
* ``UnitResult`` decisions go to the session as :class:`UnitOutcome`;
* a hard interrupt sends ``Control.interrupt(new_epoch)`` down every live stream; each stage's
  ``InterruptAck`` is reported as :class:`StageAck`, and the old turn's talker/code2wav streams are then
  closed. Outputs stamped with an older epoch are dropped here and again by the session (double fence).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from gateway.realtime import metrics
from gateway.stage_clients import StageFailure, StageSet, StageStream
from services.common.pb import code2wav_pb2, common_pb2, talker_pb2, thinker_pb2
from services.common.tensors import pcm_from_float, pcm_to_float

if TYPE_CHECKING:
    from gateway.realtime.session import DuplexSession
    from gateway.realtime.settings import RealtimeSettings

log = logging.getLogger(__name__)

_STAGE_ERROR_CODES = {
    common_pb2.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED: "context_length_exceeded",
    common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED: "resource_exhausted",
    common_pb2.ERROR_CODE_UNAVAILABLE: "stage_unavailable",
}
_ACK_WAIT_S = 5.0
_CLOSE_WAIT_S = 2.0


# ------------------------------------------------------------------------------------------ events


@dataclass
class UnitOutcome:
    epoch: int
    unit_seq: int
    decision: str  # "speak" | "listen"
    transcript: str
    turn_end: bool
    context_tokens: int
    speech_turn: int = 0  # the pipeline's speaking turn this unit's speech went to (0: none)


@dataclass
class AudioOut:
    epoch: int
    samples: np.ndarray  # float32 mono 24 kHz
    is_last: bool
    speech_turn: int = 0


@dataclass
class StageAck:
    stage: str
    new_epoch: int
    dropped: int


@dataclass
class PipelineFailure:
    """A stage stream of the session failed; reported once per failed stream.

    ``stage == "thinker"`` means the session's model state (the thinker's duplex KV) is gone and the
    session cannot go on; a talker or code2wav failure loses only the voice of one speaking turn
    (``epoch`` is that turn's epoch).
    """

    code: str
    message: str
    stage: str = ""
    epoch: int = field(default=0)


PipelineEvent = UnitOutcome | AudioOut | StageAck | PipelineFailure


class SessionPipeline(Protocol):
    def push_unit(
        self, samples: np.ndarray, frames: list[bytes], unit_seq: int, epoch: int, turn_id: int, request_response: bool
    ) -> None: ...

    def allow_speech_from(self, unit_seq: int, first_unit_of_request: int) -> None: ...

    def end_speech(self, epoch: int, speech_turn: int = 0) -> None: ...

    def interrupt(self, new_epoch: int, reason: str) -> None: ...

    async def close(self) -> None: ...


# ------------------------------------------------------------------------------------------ gRPC pipeline


def _failure_code(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, StageFailure):
        code = exc.code
        if code in ("unavailable", "stage_unavailable"):
            code = "stage_unavailable"
        elif code not in ("context_length_exceeded", "resource_exhausted", "invalid_argument"):
            code = "engine_error"
        return code, str(exc)
    return "engine_error", f"{type(exc).__name__}: {exc}"


class _SpeechTurn:
    """Talker + code2wav streams of one speaking turn."""

    def __init__(self, epoch: int, turn_id: int, talker: StageStream, code2wav: StageStream) -> None:
        self.epoch = epoch
        self.turn_id = turn_id
        self.talker = talker
        self.code2wav = code2wav
        self.tasks: list[asyncio.Task[None]] = []
        self.talker_chunk_seq = 1
        self.ending = False
        self.finished = False
        self.interrupted = False
        self.acked: set[str] = set()
        self.all_acked = asyncio.Event()
        self.failed = False  # a stream of this turn failed (reported once); its streams are cancelled

    def note_ack(self, stage: str) -> None:
        self.acked.add(stage)
        if {"talker", "code2wav"} <= self.acked:
            self.all_acked.set()


class GrpcDuplexPipeline:
    def __init__(self, session: DuplexSession, stages: StageSet, settings: RealtimeSettings) -> None:
        self.session = session
        self.stages = stages
        self.settings = settings
        self.thinker: StageStream | None = None
        self._outbox: asyncio.Queue[Any] = asyncio.Queue()  # ordered writes to the thinker
        self._tasks: list[asyncio.Task[None]] = []
        self.turn: _SpeechTurn | None = None
        self.epoch = 0
        self.speech_from_unit: int | None = None  # turn lane: speech only from the requested unit on
        self._in_seq = 0
        self._speech_turns = 0
        self._live_turns: set[_SpeechTurn] = set()
        self._unit_turn: dict[int, int] = {}  # unit_seq -> speaking turn its speech chunk went to
        self._interrupt_sent = 0.0
        self._closed = False
        self._thinker_failed = False  # reported once; the session ends on it
        self._voice_failed_epoch = -1  # a talker/code2wav failure drops that epoch's speech until the fence
        self._side_tasks: set[asyncio.Task[None]] = set()  # fire-and-forget work, kept referenced until done
        self.ref_pcm = pcm_from_float(session.cfg.ref_audio, 16_000) if session.cfg.ref_audio is not None else None

    # ---------------------------------------------------------------- session-facing API

    def push_unit(
        self, samples: np.ndarray, frames: list[bytes], unit_seq: int, epoch: int, turn_id: int, request_response: bool
    ) -> None:
        if self._closed:
            return
        self._ensure_thinker()
        unit = thinker_pb2.ThinkerUnit(
            id=self._identity(epoch, turn_id, unit_seq),
            audio=pcm_from_float(samples, 16_000),
            frames=frames,
            request_response=request_response,
        )
        self._outbox.put_nowait(thinker_pb2.ThinkerRequest(unit=unit))

    def allow_speech_from(self, unit_seq: int, first_unit_of_request: int) -> None:
        self.speech_from_unit = unit_seq

    def end_speech(self, epoch: int, speech_turn: int = 0) -> None:
        """The response voiced by ``speech_turn`` (0: the current turn) is over: end its talker input.

        A turn whose thinker chunk carried ``turn_end`` was already ended by the pipeline itself; naming
        the turn keeps a late call from ending the model's *next* turn by mistake.
        """
        if not self.session.cfg.auto_response:
            self.speech_from_unit = None  # turn lane: no speech until the next requested response
        turn = self.turn
        if turn is None or turn.epoch != epoch or (speech_turn and turn.turn_id != speech_turn):
            return
        self._end_turn(turn)

    def _end_turn(self, turn: _SpeechTurn) -> None:
        if not turn.ending:
            turn.ending = True
            self._spawn(self._end_turn_input(turn))

    def _spawn(self, coro: Any) -> None:
        """Run ``coro`` as a task the pipeline keeps a reference to (asyncio only keeps weak ones, so an
        unreferenced task can vanish mid-flight) and cancels on close."""
        task = asyncio.create_task(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    def interrupt(self, new_epoch: int, reason: str) -> None:
        self.epoch = new_epoch
        self._interrupt_sent = time.monotonic()
        self.speech_from_unit = None
        if self.thinker is not None:
            ctl = common_pb2.Control(
                id=self._identity(new_epoch, self.session.turn_id, 0),
                interrupt=common_pb2.Interrupt(new_epoch=new_epoch, reason=reason),
            )
            self._outbox.put_nowait(thinker_pb2.ThinkerRequest(control=ctl))
        self.turn = None
        for turn in list(self._live_turns):  # the current turn and any older one still finishing its audio
            if not turn.finished and not turn.interrupted:
                turn.interrupted = True
                self._spawn(self._interrupt_turn(turn, new_epoch, reason))

    async def close(self) -> None:
        """Abort every stage stream of the session (which frees its KV/caches) and stop the pumps.

        The RPCs are cancelled first, so no pump can stay blocked on a stage; the wait for the pumps to
        unwind is bounded, so a slow stage can never hold up ``session.closed``.
        """
        if self._closed:
            return
        self._closed = True
        for turn in list(self._live_turns):
            self._cancel_turn(turn)
        self.turn = None
        if self.thinker is not None:
            self.thinker.cancel()
        tasks = [*self._tasks, *self._side_tasks]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_CLOSE_WAIT_S)

    # ---------------------------------------------------------------- thinker

    def _identity(self, epoch: int, turn_id: int, unit_seq: int) -> common_pb2.Identity:
        ident = common_pb2.Identity(
            request_id=self.session.id, session_id=self.session.id, epoch=epoch, turn_id=turn_id,
            unit_seq=unit_seq, chunk_seq=self._in_seq,
        )
        self._in_seq += 1
        return ident

    def _ensure_thinker(self) -> None:
        if self.thinker is not None:
            return
        cfg = self.session.cfg
        self.thinker = self.stages["thinker"].open_stream(deadline_s=24 * 3600.0)
        sampling = thinker_pb2.SamplingParams()
        if cfg.temperature is not None:
            sampling.temperature = cfg.temperature
        if self.settings.seed is not None:
            sampling.seed = self.settings.seed
        open_msg = thinker_pb2.ThinkerOpen(
            id=self._identity(0, 0, 0),
            mode=thinker_pb2.STREAM_MODE_DUPLEX,
            sampling=sampling,
            want_speech="audio" in cfg.modalities,
            instructions=cfg.instructions,
            force_listen_units=cfg.force_listen_count,
            hidden_dtype=common_pb2.DTYPE_BFLOAT16 if self.settings.hidden_dtype == "bf16" else common_pb2.DTYPE_FLOAT32,
        )
        if self.ref_pcm is not None:
            open_msg.ref_audio.CopyFrom(self.ref_pcm)
        if cfg.initial_user_text:
            open_msg.messages.append(
                thinker_pb2.ChatMessage(role="user", content=[thinker_pb2.ContentPart(text=cfg.initial_user_text)])
            )
        self._outbox.put_nowait(thinker_pb2.ThinkerRequest(open=open_msg))
        self._tasks.append(asyncio.create_task(self._thinker_writer(self.thinker)))
        self._tasks.append(asyncio.create_task(self._thinker_reader(self.thinker)))

    async def _thinker_writer(self, stream: StageStream) -> None:
        try:
            while True:
                msg = await self._outbox.get()
                await stream.write(msg)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - reported to the session, never raised into the loop
            self._thinker_raised(exc)

    async def _thinker_reader(self, stream: StageStream) -> None:
        try:
            async for resp in stream.responses():
                kind = resp.WhichOneof("kind")
                if kind == "unit":
                    await self._on_unit_result(resp.unit)
                elif kind == "speech":
                    await self._on_speech(resp.speech)
                elif kind == "interrupt_ack":
                    ack = resp.interrupt_ack
                    metrics.BARGE_IN_STAGE.labels("thinker").observe(time.monotonic() - self._interrupt_sent)
                    self.session.post_pipeline(StageAck("thinker", int(ack.new_epoch), int(ack.dropped_items)))
                elif kind == "error":
                    # The thinker ends a duplex stream after an error: the session's model state is gone.
                    err = resp.error
                    code = _STAGE_ERROR_CODES.get(err.code, "engine_error")
                    self._fail_thinker(code, f"thinker: {err.message}")
                    return
                elif kind == "done":
                    break
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001
            self._thinker_raised(exc)
            return
        # The gateway never ends the thinker stream of a live session, so an end here is a failure too.
        self._fail_thinker("engine_error", "thinker: the duplex stream ended unexpectedly")

    async def _on_unit_result(self, unit: thinker_pb2.UnitResult) -> None:
        epoch = int(unit.id.epoch)
        if epoch < self.epoch:
            return  # fence: an interrupted epoch
        decision = "speak" if unit.decision == thinker_pb2.UNIT_DECISION_SPEAK else "listen"
        self.session.post_pipeline(
            UnitOutcome(epoch, int(unit.id.unit_seq), decision, unit.transcript, bool(unit.turn_end),
                        int(unit.context_tokens), self._unit_turn.pop(int(unit.id.unit_seq), 0))
        )

    async def _on_speech(self, chunk: thinker_pb2.SpeechChunk) -> None:
        epoch = int(chunk.id.epoch)
        if epoch < self.epoch or "audio" not in self.session.cfg.modalities:
            return
        if self.speech_from_unit is not None and chunk.id.unit_seq < self.speech_from_unit:
            return  # turn lane: the model spoke on a unit nobody asked it to answer
        if self.speech_from_unit is None and not self.session.cfg.auto_response:
            return  # turn lane with no requested response
        if epoch <= self._voice_failed_epoch:
            return  # a speaking turn of this epoch lost its voice; the session fences the epoch next
        turn = self.turn
        if turn is None or turn.finished or turn.ending:
            self._speech_turns += 1
            opened = await self._open_turn(epoch, self._speech_turns)
            if opened is None:
                return
            turn = opened
        self._unit_turn[int(chunk.id.unit_seq)] = turn.turn_id
        talker_chunk = talker_pb2.TalkerChunk(
            id=common_pb2.Identity(
                request_id=self.session.id, session_id=self.session.id, epoch=epoch,
                turn_id=turn.turn_id, unit_seq=chunk.id.unit_seq, chunk_seq=turn.talker_chunk_seq,
            ),
            token_ids=chunk.token_ids,
            hidden=chunk.hidden,
            turn_end=chunk.turn_end,
            is_last=False,
        )
        turn.talker_chunk_seq += 1
        try:
            await turn.talker.write(talker_pb2.TalkerRequest(chunk=talker_chunk))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001
            self._fail_turn(turn, "talker", exc)
            return
        if chunk.turn_end:
            self._end_turn(turn)  # decided here, in stream order: the next speech opens a new turn

    # ---------------------------------------------------------------- talker + code2wav

    async def _open_turn(self, epoch: int, turn_id: int) -> _SpeechTurn | None:
        """Open the talker + code2wav streams of a speaking turn; None (failure reported) if either refuses."""
        talker = self.stages["talker"].open_stream(deadline_s=3600.0)
        code2wav = self.stages["code2wav"].open_stream(deadline_s=3600.0)
        turn = _SpeechTurn(epoch, turn_id, talker, code2wav)
        self.turn = turn
        self._live_turns.add(turn)
        open_id = common_pb2.Identity(request_id=self.session.id, session_id=self.session.id, epoch=epoch, turn_id=turn_id)
        tsampling = talker_pb2.TalkerSampling()
        if self.settings.seed is not None:
            tsampling.seed = self.settings.seed
        c2w_open = code2wav_pb2.Code2WavOpen(id=open_id, output_format=common_pb2.PCM_FORMAT_S16LE)
        if self.settings.seed is not None:
            c2w_open.seed = self.settings.seed
        if self.ref_pcm is not None:
            c2w_open.ref_audio.CopyFrom(self.ref_pcm)
        stage = "talker"
        try:
            await talker.write(
                talker_pb2.TalkerRequest(open=talker_pb2.TalkerOpen(id=open_id, mode=thinker_pb2.STREAM_MODE_DUPLEX,
                                                                    sampling=tsampling))
            )
            stage = "code2wav"
            await code2wav.write(code2wav_pb2.Code2WavRequest(open=c2w_open))
        except asyncio.CancelledError:
            self._cancel_turn(turn)
            raise
        except BaseException as exc:  # noqa: BLE001 - reported to the session, never raised into the reader
            self._fail_turn(turn, stage, exc)
            return None
        turn.tasks.append(asyncio.create_task(self._talker_pump(turn)))
        turn.tasks.append(asyncio.create_task(self._code2wav_pump(turn)))
        return turn

    async def _end_turn_input(self, turn: _SpeechTurn) -> None:
        """No more speech for this turn: End the talker, which closes the turn and answers Done."""
        try:
            end = common_pb2.Control(id=common_pb2.Identity(epoch=turn.epoch, turn_id=turn.turn_id), end=common_pb2.End())
            await turn.talker.write(talker_pb2.TalkerRequest(control=end))
            await turn.talker.done_writing()
        except BaseException as exc:  # noqa: BLE001
            if not turn.interrupted:
                self._fail_turn(turn, "talker", exc)

    async def _talker_pump(self, turn: _SpeechTurn) -> None:
        last_sent = False
        seq = 0  # code2wav numbers windows from 0 (the open message is not counted)
        try:
            async for resp in turn.talker.responses():
                kind = resp.WhichOneof("kind")
                if kind == "window":
                    if resp.window.id.epoch < turn.epoch or turn.interrupted:
                        continue
                    window = common_pb2.CodecWindow()
                    window.CopyFrom(resp.window)
                    window.id.chunk_seq = seq
                    seq += 1
                    await turn.code2wav.write(code2wav_pb2.Code2WavRequest(window=window))
                    last_sent = last_sent or window.is_last
                elif kind == "interrupt_ack":
                    ack = resp.interrupt_ack
                    turn.note_ack("talker")
                    metrics.BARGE_IN_STAGE.labels("talker").observe(time.monotonic() - self._interrupt_sent)
                    self.session.post_pipeline(StageAck("talker", int(ack.new_epoch), int(ack.dropped_items)))
                elif kind == "error":
                    err = resp.error
                    if not turn.interrupted:
                        code = _STAGE_ERROR_CODES.get(err.code, "engine_error")
                        self._fail_turn(turn, "talker", None, code, f"talker: {err.message}")
                    return
                elif kind == "done":
                    break
            if turn.interrupted:
                return
            if not last_sent:
                end = common_pb2.Control(id=common_pb2.Identity(epoch=turn.epoch), end=common_pb2.End())
                await turn.code2wav.write(code2wav_pb2.Code2WavRequest(control=end))
            await turn.code2wav.done_writing()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001
            if not turn.interrupted:
                self._fail_turn(turn, "talker", exc)

    async def _code2wav_pump(self, turn: _SpeechTurn) -> None:
        sent_last = False
        try:
            async for resp in turn.code2wav.responses():
                kind = resp.WhichOneof("kind")
                if kind == "audio":
                    if resp.audio.id.epoch < turn.epoch or turn.interrupted or sent_last:
                        continue
                    samples, rate = pcm_to_float(resp.audio.pcm)
                    if rate != 24_000 and samples.size:
                        from gateway.realtime.audio import resample

                        samples = resample(samples, rate, 24_000)
                    sent_last = bool(resp.audio.is_last)
                    self.session.post_pipeline(AudioOut(turn.epoch, samples, sent_last, turn.turn_id))
                elif kind == "interrupt_ack":
                    ack = resp.interrupt_ack
                    turn.note_ack("code2wav")
                    metrics.BARGE_IN_STAGE.labels("code2wav").observe(time.monotonic() - self._interrupt_sent)
                    self.session.post_pipeline(StageAck("code2wav", int(ack.new_epoch), int(ack.dropped_items)))
                elif kind == "error":
                    err = resp.error
                    if not turn.interrupted:
                        code = _STAGE_ERROR_CODES.get(err.code, "engine_error")
                        self._fail_turn(turn, "code2wav", None, code, f"code2wav: {err.message}")
                    return
                elif kind == "done":
                    break
            if not turn.interrupted and not turn.failed and not sent_last:
                self.session.post_pipeline(AudioOut(turn.epoch, np.zeros(0, dtype=np.float32), True, turn.turn_id))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001
            if not turn.interrupted:
                self._fail_turn(turn, "code2wav", exc)
        finally:
            turn.finished = True
            self._live_turns.discard(turn)
            if self.turn is turn:
                self.turn = None
            turn.talker.cancel()
            turn.code2wav.cancel()

    async def _interrupt_turn(self, turn: _SpeechTurn, new_epoch: int, reason: str) -> None:
        """Fence the turn's talker and code2wav at the new epoch, wait for their acks, then close them."""
        ctl = common_pb2.Control(
            id=common_pb2.Identity(request_id=self.session.id, session_id=self.session.id, epoch=new_epoch),
            interrupt=common_pb2.Interrupt(new_epoch=new_epoch, reason=reason),
        )
        with contextlib.suppress(BaseException):
            await turn.talker.write(talker_pb2.TalkerRequest(control=ctl))
        with contextlib.suppress(BaseException):
            await turn.code2wav.write(code2wav_pb2.Code2WavRequest(control=ctl))
        # The pumps keep reading and report the acks; give them a bounded time before closing.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(turn.all_acked.wait(), _ACK_WAIT_S)
        self._cancel_turn(turn)

    def _cancel_turn(self, turn: _SpeechTurn) -> None:
        turn.finished = True
        self._live_turns.discard(turn)
        if self.turn is turn:
            self.turn = None
        current = asyncio.current_task()
        for task in turn.tasks:
            if task is not current:  # a pump failing its own turn returns on its own
                task.cancel()
        turn.talker.cancel()
        turn.code2wav.cancel()

    def _thinker_raised(self, exc: BaseException) -> None:
        """A thinker stream call raised: report it (once) with the stable code of the failure."""
        code, message = _failure_code(exc)
        self._fail_thinker(code, message)

    def _fail_thinker(self, code: str, message: str) -> None:
        if self._closed or self._thinker_failed:
            return
        self._thinker_failed = True
        log.warning("duplex session %s: thinker failed (%s): %s", self.session.id, code, message)
        self.session.post_pipeline(PipelineFailure(code, message, "thinker"))

    def _fail_turn(
        self, turn: _SpeechTurn, stage: str, exc: BaseException | None, code: str = "", message: str = ""
    ) -> None:
        """A talker/code2wav stream of ``turn`` failed: cancel both streams of the turn (the survivor would
        otherwise wait for input that never comes) and report the failure once."""
        if turn.failed or turn.interrupted or turn.finished:
            return  # already reported, fenced by an interrupt, or done (its audio is all delivered)
        turn.failed = True
        self._cancel_turn(turn)
        if self._closed:
            return
        self._voice_failed_epoch = max(self._voice_failed_epoch, turn.epoch)
        if exc is not None:
            code, message = _failure_code(exc)
        log.warning("duplex session %s: %s failed in speaking turn %d (%s): %s",
                    self.session.id, stage, turn.turn_id, code, message)
        self.session.post_pipeline(PipelineFailure(code, message, stage, turn.epoch))


def grpc_pipeline_factory(settings: RealtimeSettings, stages: StageSet | None = None) -> Any:
    """Factory for sessions; without ``stages`` it connects to the targets named in ``settings``."""
    holder: dict[str, StageSet] = {}

    def factory(session: DuplexSession) -> GrpcDuplexPipeline:
        resolved = stages or holder.get("stages")
        if resolved is None:
            resolved = StageSet(
                {"thinker": settings.thinker_target, "talker": settings.talker_target,
                 "code2wav": settings.code2wav_target}
            )
            holder["stages"] = resolved
        return GrpcDuplexPipeline(session, resolved, settings)

    return factory
