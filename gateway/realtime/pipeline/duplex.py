"""Stage plumbing of one duplex session: one thinker duplex stream, one :class:`SpeechTurn` per speaking turn.

The session (``gateway.realtime.session``) decides *what* to send; this module moves messages between
the stages and reports back through :meth:`PipelineHost.post_pipeline` (the session's mailbox):

* units go to the thinker's duplex stream (opened lazily on the first unit, so a session that never
  sends audio never touches a stage);
* the thinker's ``SpeechChunk`` hidden states of a speaking turn go to that turn's talker and code2wav
  streams (:mod:`gateway.realtime.pipeline.speech`), which report the 24 kHz audio as :class:`AudioOut`;
* ``UnitResult`` decisions go to the session as :class:`UnitOutcome`;
* :meth:`GrpcDuplexPipeline.interrupt` — called by the session right after it advanced its epoch — sends
  ``Control.interrupt(new_epoch)`` down every live stream; each stage's ``InterruptAck`` is reported as
  :class:`StageAck`, and the old turn's streams are then closed. Outputs stamped with an epoch older than
  the session's are dropped here and again by the session (double fence).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from gateway.realtime import metrics
from gateway.realtime.audio import UNIT_SAMPLES
from gateway.realtime.errors import RealtimeError
from gateway.realtime.pipeline.events import (
    PipelineFailure,
    PipelineHost,
    StageAck,
    UnitOutcome,
    UnitRole,
)
from gateway.realtime.pipeline.speech import SpeechTurn, failure_code, stage_error_code
from gateway.realtime.response_options import ResponseOptions
from gateway.realtime.settings import RealtimeSettings
from gateway.realtime.tools import ToolSet
from gateway.stage_clients import StageSet
from gateway.stage_stream_client import StageStream
from services.common.pb import common_pb2, thinker_pb2
from services.common.pcm import pcm_from_float

log = logging.getLogger(__name__)

_CLOSE_WAIT_S = 2.0
_CONTROL_ROOM = 64  # outbox places beyond the unit bound, for the open message and interrupts


class GrpcDuplexPipeline:
    """The gRPC pipeline of one session (see the module docstring)."""

    def __init__(self, host: PipelineHost, stages: StageSet, settings: RealtimeSettings) -> None:
        self.host = host
        self.stages = stages
        self.settings = settings
        self.thinker: StageStream | None = None
        # Ordered writes to the thinker, bounded: the session refuses input past max_pending_input_bytes
        # (counted until the thinker decides a unit), so at most that many units wait here, plus controls.
        self.max_queued_units = max(1, settings.max_pending_input_bytes // (UNIT_SAMPLES * 4))
        self._outbox: asyncio.Queue[thinker_pb2.ThinkerRequest] = asyncio.Queue(
            self.max_queued_units + _CONTROL_ROOM
        )
        self._tasks: list[asyncio.Task[None]] = []
        self.turn: SpeechTurn | None = None
        self.speech_from_unit: int | None = None  # turn lane: speech only from the requested unit on
        self.request_started: float | None = None  # turn lane: when the response was asked for (until speech)
        self._decision_due: float | None = None  # the same, until the requesting unit's decision
        self._in_seq = 0
        self._speech_turns = 0
        self._live_turns: set[SpeechTurn] = set()
        self._unit_turn: dict[int, int] = {}  # unit_seq -> speaking turn its speech chunk went to
        self._interrupt_sent = 0.0
        self._closed = False
        self._thinker_failed = False  # reported once; the session ends on it
        self._voice_failed_epoch = -1  # a talker/code2wav failure drops that epoch's speech until the fence
        self._side_tasks: set[asyncio.Task[None]] = set()  # fire-and-forget work, kept referenced until done
        # Per-response options (ResponseOptions): whether the current response is voiced, and the note and
        # token budget the next unit that asks for a response carries to the thinker.
        self.voice = "audio" in host.cfg.modalities
        self._next_instructions = ""
        self._next_budget = 0
        # Function tools of the current response (None: the session's) and the client's function results
        # not yet sent: they ride on the next unit, whatever its role.
        self.tools: ToolSet | None = None
        self._tool_outputs: list[str] = []
        ref_audio = host.cfg.ref_audio
        self.ref_pcm = pcm_from_float(ref_audio, 16_000) if ref_audio is not None else None

    # ---------------------------------------------------------------- session-facing API

    def push_unit(
        self,
        samples: np.ndarray,
        frames: list[bytes],
        unit_seq: int,
        epoch: int,
        turn_id: int,
        role: UnitRole = UnitRole.PLAIN,
    ) -> None:
        if self._closed:
            return
        if self._outbox.qsize() >= self.max_queued_units:
            raise RealtimeError("input_backpressure", "the queue toward the thinker is full")
        self._ensure_thinker()
        unit = thinker_pb2.ThinkerUnit(
            id=self._identity(epoch, turn_id, unit_seq),
            audio=pcm_from_float(samples, 16_000),
            frames=frames,
            request_response=role is UnitRole.REQUEST,
            force_listen=role is UnitRole.LISTEN,
            continue_turn=role is UnitRole.CONTINUE,
        )
        cfg = self.host.cfg
        if role is UnitRole.REQUEST:
            unit.instructions, self._next_instructions = self._next_instructions, ""
            unit.max_output_tokens, self._next_budget = self._next_budget, 0
        elif role is UnitRole.PLAIN and cfg.auto_response and cfg.max_response_output_tokens:
            # Native lane: a model-initiated turn gets the session's budget (the thinker applies it only
            # when the unit starts a model turn).
            unit.max_output_tokens = cfg.max_response_output_tokens
        # Every unit carries the tools in effect (the thinker places them in the context when they change;
        # a forced choice applies only where a model turn starts) and the results sent since the last unit.
        tools = self.tools if self.tools is not None else cfg.tools
        unit.tools_json.extend(tools.signatures())
        grammar = tools.grammar()
        if grammar is not None:
            unit.tool_call.CopyFrom(grammar)
            unit.tool_call_forced = tools.forced
        unit.tool_outputs.extend(self._tool_outputs)
        self._tool_outputs.clear()
        self._outbox.put_nowait(thinker_pb2.ThinkerRequest(unit=unit))

    def begin_response(self, options: ResponseOptions) -> None:
        """The next response (asked for by the next ``REQUEST`` unit) is voiced or not and runs with its tools,
        and that unit carries the response's instructions and token budget to the thinker."""
        self.voice = options.wants_audio
        self.tools = options.tools
        self._next_instructions = options.instructions
        self._next_budget = options.max_output_tokens

    def add_tool_output(self, output: str) -> None:
        self._tool_outputs.append(output)

    def allow_speech_from(self, unit_seq: int, first_unit_of_request: int) -> None:
        self.speech_from_unit = unit_seq
        self.request_started = self._decision_due = time.monotonic()

    def end_speech(self, epoch: int, speech_turn: int = 0) -> None:
        """The response voiced by ``speech_turn`` (0: the current turn) is over: end its talker input.

        A turn whose thinker chunk carried ``turn_end`` was already ended by the pipeline itself; naming
        the turn keeps a late call from ending the model's *next* turn by mistake.
        """
        if not self.host.cfg.auto_response:
            self.speech_from_unit = None  # turn lane: no speech until the next requested response
        self.voice = "audio" in self.host.cfg.modalities  # a per-response choice ends with its response
        self.tools = None
        turn = self.turn
        if turn is None or turn.epoch != epoch or (speech_turn and turn.turn_id != speech_turn):
            return
        self._spawn(turn.end_input())

    def interrupt(self, new_epoch: int, reason: str) -> None:
        self._interrupt_sent = time.monotonic()
        self.speech_from_unit = None
        self.voice = "audio" in self.host.cfg.modalities
        self.tools = None
        if self.thinker is not None:
            ctl = common_pb2.Control(
                id=self._identity(new_epoch, self.host.turn_id, 0),
                interrupt=common_pb2.Interrupt(new_epoch=new_epoch, reason=reason),
            )
            self._outbox.put_nowait(thinker_pb2.ThinkerRequest(control=ctl))
        self.turn = None
        for turn in list(self._live_turns):  # the current turn and any older one still finishing its audio
            self._spawn(turn.interrupt(new_epoch, reason))

    async def close(self) -> None:
        """Abort every stage stream of the session (which frees its KV/caches) and stop the pumps.

        The RPCs are cancelled first, so no pump can stay blocked on a stage; the wait for the pumps to
        unwind is bounded, so a slow stage can never hold up ``session.closed``.
        """
        if self._closed:
            return
        self._closed = True
        for turn in list(self._live_turns):
            turn.cancel()
        self.turn = None
        if self.thinker is not None:
            self.thinker.cancel()
        tasks = [*self._tasks, *self._side_tasks]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_CLOSE_WAIT_S)

    def _spawn(self, coro: Coroutine[Any, Any, None] | None) -> None:
        """Run ``coro`` as a task the pipeline keeps a reference to (asyncio only keeps weak ones, so an
        unreferenced task can vanish mid-flight) and cancels on close."""
        if coro is None:
            return
        task = asyncio.create_task(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    # ---------------------------------------------------------------- thinker

    def _identity(self, epoch: int, turn_id: int, unit_seq: int) -> common_pb2.Identity:
        ident = common_pb2.Identity(
            request_id=self.host.id,
            session_id=self.host.id,
            epoch=epoch,
            turn_id=turn_id,
            unit_seq=unit_seq,
            chunk_seq=self._in_seq,
        )
        self._in_seq += 1
        return ident

    def _ensure_thinker(self) -> None:
        if self.thinker is not None:
            return
        cfg = self.host.cfg
        self.thinker = self.stages["thinker"].open_stream(deadline_s=24 * 3600.0)
        sampling = thinker_pb2.SamplingParams()
        if cfg.temperature is not None:
            sampling.temperature = cfg.temperature
        if self.settings.seed is not None:
            sampling.seed = self.settings.seed
        open_msg = thinker_pb2.ThinkerOpen(
            # The session's epoch: after a resume the new stream starts where the session is.
            id=self._identity(self.host.epoch, 0, 0),
            mode=common_pb2.STREAM_MODE_DUPLEX,
            sampling=sampling,
            # With a reference voice any response may ask for speech (response.create output_modalities),
            # so the thinker exports the spoken span whenever a voice exists; text-only responses drop it.
            want_speech="audio" in cfg.modalities or self.ref_pcm is not None,
            instructions=cfg.instructions,
            force_listen_units=cfg.force_listen_count,
            hidden_dtype=common_pb2.DTYPE_BFLOAT16
            if self.settings.hidden_dtype == "bf16"
            else common_pb2.DTYPE_FLOAT32,
        )
        if cfg.thinker_voice is not None:  # a registered voice: its stored rows, never encoded again
            open_msg.voice.CopyFrom(cfg.thinker_voice)
        elif self.ref_pcm is not None:
            open_msg.ref_audio.CopyFrom(self.ref_pcm)
        if cfg.initial_user_text:
            open_msg.messages.append(
                thinker_pb2.ChatMessage(
                    role="user", content=[thinker_pb2.ContentPart(text=cfg.initial_user_text)]
                )
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
            self._fail_thinker(*failure_code(exc))

    async def _thinker_reader(self, stream: StageStream) -> None:
        try:
            async for resp in stream.responses():
                kind = resp.WhichOneof("kind")
                if kind == "unit":
                    self._on_unit_result(resp.unit)
                elif kind == "speech":
                    await self._on_speech(resp.speech)
                elif kind == "interrupt_ack":
                    ack = resp.interrupt_ack
                    metrics.BARGE_IN_STAGE.labels("thinker").observe(time.monotonic() - self._interrupt_sent)
                    self.host.post_pipeline(StageAck("thinker", int(ack.new_epoch), int(ack.dropped_items)))
                elif kind == "error":
                    # The thinker ends a duplex stream after an error: the session's model state is gone.
                    self._fail_thinker(stage_error_code(resp.error), f"thinker: {resp.error.message}")
                    return
                elif kind == "done":
                    break
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001
            self._fail_thinker(*failure_code(exc))
            return
        # The gateway never ends the thinker stream of a live session, so an end here is a failure too.
        self._fail_thinker("engine_error", "thinker: the duplex stream ended unexpectedly")

    def _on_unit_result(self, unit: thinker_pb2.UnitResult) -> None:
        epoch = int(unit.id.epoch)
        if epoch < self.host.epoch:
            return  # fence: an interrupted epoch
        decision = "speak" if unit.decision == thinker_pb2.UNIT_DECISION_SPEAK else "listen"
        if self._decision_due is not None and unit.id.unit_seq == self.speech_from_unit:
            metrics.FIRST_AUDIO_PHASE.labels("decision").observe(time.monotonic() - self._decision_due)
            self._decision_due = None
        self.host.post_pipeline(
            UnitOutcome(
                epoch,
                int(unit.id.unit_seq),
                decision,
                unit.transcript,
                bool(unit.turn_end),
                int(unit.context_tokens),
                self._unit_turn.pop(int(unit.id.unit_seq), 0),
                output_tokens=len(unit.token_ids),
                context_before=int(unit.context_before),
                max_tokens_reached=bool(unit.max_tokens_reached),
                tool_call=unit.tool_call,
                tool_call_truncated=bool(unit.tool_call_truncated),
                tool_error=unit.tool_error,
            )
        )

    async def _on_speech(self, chunk: thinker_pb2.SpeechChunk) -> None:
        epoch = int(chunk.id.epoch)
        cfg = self.host.cfg
        if epoch < self.host.epoch or not self.voice:
            return  # fenced, or a text-only response (the session's or this response's choice)
        if self.speech_from_unit is not None and chunk.id.unit_seq < self.speech_from_unit:
            return  # turn lane: the model spoke on a unit nobody asked it to answer
        if self.speech_from_unit is None and not cfg.auto_response:
            return  # turn lane with no requested response
        if epoch <= self._voice_failed_epoch:
            return  # a speaking turn of this epoch lost its voice; the session fences the epoch next
        turn = self.turn
        if turn is None or turn.finished or turn.ending:
            self._speech_turns += 1
            turn = self._new_turn(epoch, self._speech_turns)
            if self.request_started is not None:  # the first speech of the requested response
                metrics.FIRST_AUDIO_PHASE.labels("speech").observe(time.monotonic() - self.request_started)
                turn.request_started, self.request_started = self.request_started, None
            if not await turn.start():
                return
        self._unit_turn[int(chunk.id.unit_seq)] = turn.turn_id
        await turn.send_speech(chunk)
        if chunk.turn_end:
            self._spawn(turn.end_input())  # decided here, in stream order: the next speech opens a new turn

    # ---------------------------------------------------------------- speaking turns and failures

    def _new_turn(self, epoch: int, turn_id: int) -> SpeechTurn:
        """Open the talker + code2wav streams of a speaking turn; it is live (interruptible) at once."""
        turn = SpeechTurn(
            session_id=self.host.id,
            epoch=epoch,
            turn_id=turn_id,
            stages=self.stages,
            settings=self.settings,
            ref_pcm=self.ref_pcm,
            voice_prompt=self.host.cfg.voice_prompt,
            report=self.host.post_pipeline,
            on_failure=self._turn_failed,
            on_finished=self._turn_finished,
        )
        self.turn = turn
        self._live_turns.add(turn)
        return turn

    def _turn_finished(self, turn: SpeechTurn) -> None:
        self._live_turns.discard(turn)
        if self.turn is turn:
            self.turn = None

    def _turn_failed(self, turn: SpeechTurn, stage: str, code: str, message: str) -> None:
        """A talker/code2wav stream failed (the turn has cancelled itself): drop the rest of that epoch's
        speech and report it once."""
        if self._closed:
            return
        self._voice_failed_epoch = max(self._voice_failed_epoch, turn.epoch)
        log.warning(
            "duplex session %s: %s failed in speaking turn %d (%s): %s",
            self.host.id,
            stage,
            turn.turn_id,
            code,
            message,
        )
        self.host.post_pipeline(PipelineFailure(code, message, stage, turn.epoch))

    def _fail_thinker(self, code: str, message: str) -> None:
        if self._closed or self._thinker_failed:
            return
        self._thinker_failed = True
        log.warning("duplex session %s: thinker failed (%s): %s", self.host.id, code, message)
        self.host.post_pipeline(PipelineFailure(code, message, "thinker"))


def grpc_pipeline_factory(
    settings: RealtimeSettings, stages: StageSet | None = None
) -> Callable[[PipelineHost], GrpcDuplexPipeline]:
    """Factory for sessions; without ``stages`` it connects (once, on first use) to the targets in ``settings``."""
    holder: dict[str, StageSet] = {}

    def factory(host: PipelineHost) -> GrpcDuplexPipeline:
        resolved = stages or holder.get("stages")
        if resolved is None:
            resolved = StageSet(
                {
                    "thinker": settings.thinker_target,
                    "talker": settings.talker_target,
                    "code2wav": settings.code2wav_target,
                }
            )
            holder["stages"] = resolved
        return GrpcDuplexPipeline(host, resolved, settings)

    return factory
