"""One duplex session: the state machine behind a realtime socket (docs/protocol.md, Realtime commands to
Realtime session end).

Everything that changes session state runs on one asyncio task per session (the mailbox loop): client
commands, pipeline outputs and (re)attachments are processed strictly in arrival order, so outbound
event order, epochs and the journal never race. Sockets only read frames into the mailbox and drain
their outbound queue.

The file is about 550 lines on purpose: it is the one owner of the session's state (epoch, attachment,
unit clock, backlog), so every method that changes that state lives here; the parts with their own
invariants are already their own modules (input_buffer, conversation, attachment, lifecycle, journal).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from gateway.realtime import commands, metrics
from gateway.realtime import events as ev
from gateway.realtime.attachment import Attachment, hash_token
from gateway.realtime.audio import UNIT_SAMPLES, AudioUnit
from gateway.realtime.config import SessionConfig, render_session
from gateway.realtime.conversation import Conversation, FunctionCallItem, FunctionCallOutputItem, UserItem
from gateway.realtime.errors import RealtimeError
from gateway.realtime.input_buffer import InputBuffer
from gateway.realtime.journal import EventJournal
from gateway.realtime.lifecycle import ResponseLifecycle
from gateway.realtime.pipeline.events import PipelineEvent, PipelineHost, SessionPipeline, UnitRole
from gateway.realtime.server_vad import ServerVadTurns, sync_server_vad
from gateway.realtime.settings import RealtimeSettings

log = logging.getLogger(__name__)

# What the mailbox carries: a client event, a pipeline event, or a change of attachment or lifetime.
MailKind = Literal["client", "pipeline", "attach", "detach", "close", "reject", "expire", "reclaim"]


class DuplexSession:
    """The state of one realtime session, changed only by its own methods, on its own mailbox task.

    It is the single owner of the session's **epoch**: :meth:`advance_epoch` is the one place it is bumped
    (a barge-in is one call, :meth:`interrupt`); the pipeline, the speaking turns and the responses read
    it or carry the epoch they were born in. Components it owns (``input``, ``conversation``,
    ``lifecycle``, ``journal``, ``server_vad``) keep their own invariants behind their methods; other
    modules (commands, server VAD, the response lifecycle, the socket routes) read the properties below.
    """

    def __init__(
        self,
        settings: RealtimeSettings,
        cfg: SessionConfig,
        pipeline_factory: Callable[[PipelineHost], SessionPipeline],
        on_finished: Callable[[DuplexSession], None],
    ) -> None:
        self.settings = settings
        self.id = ev.new_session_id()
        self._cfg = cfg
        self._state = "open"
        self._epoch = 0
        self._turn_id = 0
        self._generation = 1
        self._resume_token: str | None = None
        self._resume_token_hash: str | None = None
        self.journal = EventJournal(ttl_s=settings.journal_ttl_s, max_bytes=settings.journal_max_bytes)
        self.attachment: Attachment | None = None  # set only by attach_new / _do_resume / _do_detach
        self.mailbox: asyncio.Queue[tuple[MailKind, Any]] = asyncio.Queue()
        self._pending_input_bytes = 0  # raw frame bytes read by the socket, not yet handled here
        self.input = InputBuffer()
        self._backlog: list[UserItem] = []  # turn lane: committed but not yet sent to the model
        self.conversation = Conversation()
        self._unit_seq = 0  # next unit index sent to the thinker
        self._interrupt_started: float | None = None  # monotonic time of the last hard interrupt
        # unit_seq -> when it went to the thinker, for the units of the current epoch it has not decided
        # yet: the decision latency metric, the input backpressure (pending until consumed) and the clock.
        self._unit_sent_at: dict[int, float] = {}
        # Function results from the client: not yet handed to the pipeline (they ride on the next unit), and
        # whether any arrived since the last response started (response.create needs input or results).
        self._tool_outputs: list[str] = []
        self._tool_results_waiting = False
        self._input_final = False  # native lane: a final commit ended the input; the silence clock runs
        self._clock_units = 0  # silent units fed since that commit (at most the response unit cap)
        self._pipeline_factory = pipeline_factory
        self.pipeline = pipeline_factory(self)
        self.lifecycle = ResponseLifecycle(self)
        self._on_finished = on_finished
        self._task: asyncio.Task[None] | None = None
        self._grace_task: asyncio.Task[None] | None = None
        # When the socket went away (monotonic), while the session waits for a resume; None when attached.
        self._detached_at: float | None = None
        self._reclaimed = False  # its admission slot went to a new session: it ends, a resume is refused
        self._server_vad: ServerVadTurns | None = None
        self._server_vad = sync_server_vad(self)
        if settings.supports_session_resume:
            self.rotate_token()

    # ---------------------------------------------------------------- read-only state

    @property
    def cfg(self) -> SessionConfig:
        return self._cfg

    @property
    def state(self) -> str:
        """``open`` until the session ends (``closed``) or its resume grace runs out (``expired``)."""
        return self._state

    @property
    def epoch(self) -> int:
        """The current epoch: outputs stamped with an older one belong to an interrupted turn."""
        return self._epoch

    @property
    def turn_id(self) -> int:
        """The number of the last committed user turn."""
        return self._turn_id

    @property
    def generation(self) -> int:
        """The attachment generation: bumped by every resume."""
        return self._generation

    @property
    def resume_token_hash(self) -> str | None:
        return self._resume_token_hash

    @property
    def server_vad(self) -> ServerVadTurns | None:
        return self._server_vad

    @property
    def committed_backlog(self) -> tuple[UserItem, ...]:
        """Turn lane: committed user items whose audio the model has not been sent yet."""
        return tuple(self._backlog)

    @property
    def tool_results_waiting(self) -> bool:
        """Function results arrived since the last response started: ``response.create`` may answer them."""
        return self._tool_results_waiting

    @property
    def pending_input_bytes(self) -> int:
        return self._pending_input_bytes

    @property
    def unit_seq(self) -> int:
        """The index the next unit sent to the thinker gets."""
        return self._unit_seq

    @property
    def interrupt_started(self) -> float | None:
        return self._interrupt_started

    @property
    def units_in_flight(self) -> int:
        """Units of the current epoch sent to the thinker and not yet decided (consumed) by it."""
        return len(self._unit_sent_at)

    @property
    def response_unit_cap(self) -> int:
        """The most units a response runs on the gateway's silence (session override, else the deployment's)."""
        return self.cfg.max_response_units or self.settings.max_response_units

    @property
    def clock_exhausted(self) -> bool:
        """Native lane after a final commit: the silence clock has fed all the units it may."""
        return self._input_final and self._clock_units >= self.response_unit_cap

    # ---------------------------------------------------------------- plumbing

    def rotate_token(self) -> str:
        self._resume_token = secrets.token_urlsafe(32)
        self._resume_token_hash = hash_token(self._resume_token)
        return self._resume_token

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"realtime-session-{self.id}")

    def post(self, kind: MailKind, payload: Any) -> None:
        self.mailbox.put_nowait((kind, payload))

    def post_pipeline(self, event: PipelineEvent) -> None:
        self.mailbox.put_nowait(("pipeline", event))

    def emit(self, type_: str, *, journaled: bool = True, **fields: Any) -> dict[str, Any]:
        event: dict[str, Any] = {"type": type_, "event_id": ev.new_event_id(), **fields}
        if journaled:
            try:
                self.journal.record(event)
            except (TypeError, ValueError, RecursionError):
                # A value JSON cannot hold is a server bug; raising here would abort the caller half-way
                # (e.g. a terminal sequence or session.closed). Report it in the event's place instead.
                log.exception("realtime session %s: cannot encode a %s event", self.id, type_)
                error = RealtimeError("internal_error", f"could not encode {type_}")
                event = {"type": "error", "event_id": ev.new_event_id(), "error": error.body()}
                self.journal.record(event)
        if self.attachment is not None:
            self.attachment.send(event)
        return event

    def emit_error(self, exc: RealtimeError) -> None:
        metrics.ERRORS.labels(exc.code).inc()
        self.emit("error", error=exc.body())

    def session_object(self) -> dict[str, Any]:
        caps = {
            "implementation_level": "model_native_duplex",
            "chunk_period_ms": 1000,
            "supports_barge_in": self.settings.supports_barge_in,
            "supports_server_vad": True,
            "supports_session_resume": self.settings.supports_session_resume,
            "supports_audio_truncate": True,
            "supports_multi_session": self.settings.max_sessions > 1,
            "supports_concurrent_turn_requests": False,
            "supports_chat_completions": True,
            "required_input_modalities": ["audio"],
            "optional_input_modalities": ["video"],
            "input_modes": ["append_audio_chunk"],
            "session_admission_mode": "engine_managed",
            "target_barge_in_latency_ms": None,
        }
        active = self.lifecycle.active
        last = self.lifecycle.last
        playback = (
            last.playback() if last else {"generated_ms": 0, "sent_ms": 0, "played_ms": 0, "committed_ms": 0}
        )
        return {
            "object": "realtime.session",
            "type": "realtime",
            "id": self.id,
            "state": self.state,
            "turn_state": "responding" if active else "idle",
            "epoch": self.epoch,
            "turn_id": self.turn_id,
            "active_response_id": active.id if active else None,
            **render_session(self.cfg),
            "playback": playback,
            "capabilities": caps,
        }

    # ---------------------------------------------------------------- lifecycle of the session

    def attach_new(self) -> Attachment:
        """First socket: announce the session (created is not journaled, updated is)."""
        self.attachment = Attachment(self.generation)
        fields: dict[str, Any] = {"session": self.session_object()}
        if self.settings.supports_session_resume:
            fields["attachment_generation"] = self.generation
            fields["resume_token"] = self._resume_token
        self.emit("session.created", journaled=False, **fields)
        self.emit("session.updated", session=self.session_object())
        return self.attachment

    async def _run(self) -> None:
        cancelled = False
        try:
            while self.state == "open":
                kind, payload = await self.mailbox.get()
                try:
                    if kind == "client":
                        await self._handle_client(*payload)
                    elif kind == "pipeline":
                        await self.lifecycle.on_pipeline(payload)
                    elif kind == "attach":
                        self._do_resume(*payload)
                    elif kind == "detach":
                        await self._do_detach(payload)
                    elif kind == "close":
                        await self.end(payload)
                    elif kind == "reject":
                        self.emit_error(payload)
                    elif kind == "expire":
                        self._expire(payload)
                    elif kind == "reclaim":
                        self._expire(payload, reason="capacity_reclaimed")
                except RealtimeError as exc:
                    self.emit_error(exc)
                except Exception as exc:  # a bug must not kill the session silently
                    log.exception("realtime session %s: unhandled error", self.id)
                    self.emit_error(RealtimeError("internal_error", f"internal error: {type(exc).__name__}"))
        except asyncio.CancelledError:
            cancelled = True  # the gateway is shutting down
            raise
        finally:
            if self.state == "open":
                # The loop itself ended (the server stops, or an error escaped the handler above): the
                # client must still learn that the session is over rather than wait on a silent socket.
                if cancelled:
                    log.info("realtime session %s: closed by the gateway's shutdown", self.id)
                else:
                    log.error("realtime session %s: session task ended while open; closing it", self.id)
                await self.end("server_shutdown" if cancelled else "internal_error")
            await self._close_pipeline()
            self._on_finished(self)

    async def _close_pipeline(self, pipeline: SessionPipeline | None = None) -> None:
        """Stop the stage streams (of ``pipeline``, default the session's), within
        ``pipeline_close_timeout_s`` and without raising.

        Session teardown must not depend on the stages: ``session.closed`` follows this however the
        pipeline's close ends (the gRPC pipeline cancels its calls first, so it normally takes
        milliseconds).
        """
        try:
            async with asyncio.timeout(self.settings.pipeline_close_timeout_s):
                await (pipeline or self.pipeline).close()
        except TimeoutError:
            log.warning(
                "realtime session %s: pipeline close took over %.1f s; closing the session anyway",
                self.id,
                self.settings.pipeline_close_timeout_s,
            )
        except Exception:
            log.exception("realtime session %s: pipeline close failed; closing the session anyway", self.id)

    async def end(self, reason: str, *, terminal_type: str = "session.closed") -> None:
        """End the session: abort the response (no cancelled ``response.done``; docs/protocol.md, Realtime
        session end), free the stages, then ``session.closed`` and socket close 1000 — the last two
        unconditionally, so that a client's ``session.close`` is always answered in bounded time."""
        if self.state != "open":
            return
        self._state = "closed"
        try:
            self.lifecycle.abort_silently()
            await self._close_pipeline()
        finally:
            event_fields: dict[str, Any] = {"session_id": self.id, "reason": reason}
            if terminal_type == "session.closed":
                event_fields["event"] = {"type": "session.closed", "reason": reason}
            self.emit(terminal_type, **event_fields)
            if self.attachment is not None:
                self.attachment.close(1000)
            if self._grace_task is not None and self._grace_task is not asyncio.current_task():
                self._grace_task.cancel()

    async def _do_detach(self, attachment: Attachment) -> None:
        """The socket went away: keep the session for the grace period if it can be resumed, but stop
        its work at once (:meth:`_suspend`), since nobody is there to hear it."""
        if attachment is not self.attachment:
            return
        attachment.detached = True
        self.attachment = None
        if not self.settings.supports_session_resume:
            self.post("close", "client_disconnected")
            return
        self._detached_at = time.monotonic()
        self._grace_task = asyncio.create_task(self._grace_expiry(self.generation))
        await self._suspend("client_disconnected")

    async def _suspend(self, reason: str) -> None:
        """Stop generating into the void while the session waits for a resume.

        What a resume needs is kept: the journal, the conversation, the configuration and the uncommitted
        input. What runs is stopped: the active response ends ``cancelled`` (its terminal events go to the
        journal, so the resumed client sees how it ended), a deferred ``response.create`` is dropped, the
        epoch advances (late outputs of the old streams are fenced) and every stage stream of the session
        is closed, which frees the thinker sequence and the talker/code2wav streams within milliseconds.
        A fresh pipeline takes the old one's place; it opens a new thinker stream (at the current epoch)
        on the first unit after the resume.
        """
        if self.state != "open":
            return
        self._epoch += 1  # no interrupt goes down: the streams are closed below
        self._unit_sent_at.clear()
        self._input_final = False
        self._clock_units = 0
        self._interrupt_started = None  # not a barge-in: keeps the cancel out of the barge-in latency
        self.lifecycle.cancel_active(reason)
        old = self.pipeline
        self.pipeline = self._pipeline_factory(self)
        await self._close_pipeline(old)
        log.info("realtime session %s: socket gone; response and stage streams stopped (%s)", self.id, reason)

    async def _grace_expiry(self, generation: int) -> None:
        await asyncio.sleep(self.settings.disconnect_grace_s)
        self.post("expire", generation)

    def _expire(self, generation: int, reason: str = "disconnect_grace_expired") -> None:
        """Grace elapsed with no socket (or its slot was reclaimed): the session ends with session.expired
        (journaled, unseen)."""
        if self.attachment is not None or self.generation != generation or self.state != "open":
            return
        self.lifecycle.abort_silently()
        self.emit("session.expired", session_id=self.id, reason=reason)
        self._state = "expired"

    @property
    def detached_at(self) -> float | None:
        """When the socket went away (``time.monotonic``), while the session waits for a resume."""
        return self._detached_at

    def reclaim(self) -> bool:
        """Give up this session's admission slot, if it has no socket and waits for a resume (the
        registry calls it, on the event loop, when a new session finds every slot taken).

        A detached session's stage work already stopped at the drop (:meth:`_suspend`); what it holds
        is only the chance of a resume. A client that ends with a plain socket close never resumes, so
        without this its slot stays taken for the whole grace. True: the session ends with
        ``session.expired{reason:"capacity_reclaimed"}`` and a resume of it, even one already on its way
        through the mailbox, gets ``session_resume_expired``. False: it is attached (or ending) and
        keeps its slot.
        """
        if (
            self._reclaimed
            or self.state != "open"
            or self.attachment is not None
            or self._detached_at is None
        ):
            return False
        self._reclaimed = True
        if self._grace_task is not None:
            self._grace_task.cancel()
            self._grace_task = None
        self.post("reclaim", self.generation)
        return True

    def _do_resume(
        self, attachment: Attachment, last_seq: int, token_hash: str, done: asyncio.Future[None]
    ) -> None:
        """Activate a new socket: replace the old one, announce, replay the journal (all atomically)."""
        if self._reclaimed:
            if not done.done():
                done.set_exception(RealtimeError("session_resume_expired", f"session {self.id} has ended"))
            return
        if token_hash != self.resume_token_hash:
            # Another socket resumed with the same token first and rotated it.
            if not done.done():
                done.set_exception(
                    RealtimeError("session_resume_conflict", "the session was resumed concurrently")
                )
            return
        if self._grace_task is not None:
            self._grace_task.cancel()
            self._grace_task = None
        self._generation += 1
        self._detached_at = None
        attachment.generation = self.generation
        old = self.attachment
        if old is not None:
            old.send(
                {
                    "type": "session.replaced",
                    "event_id": ev.new_event_id(),
                    "session_id": self.id,
                    "attachment_generation": self.generation,
                }
            )
            old.close(1000)
        token = self.rotate_token()
        self.attachment = attachment
        self.emit(
            "session.resumed",
            journaled=False,
            session_id=self.id,
            attachment_generation=self.generation,
            resume_token=token,
            session=self.session_object(),
        )
        plan = self.journal.plan_replay(last_seq)
        if plan.resync_reason is not None:
            self.emit(
                "session.resync_required", journaled=False, session_id=self.id, reason=plan.resync_reason
            )
        else:
            for event in plan.events:
                attachment.send(event)
        if not done.done():
            done.set_result(None)

    # ---------------------------------------------------------------- client commands

    async def _handle_client(self, event: dict[str, Any], raw_size: int) -> None:
        self._pending_input_bytes = max(0, self._pending_input_bytes - raw_size)
        try:
            await commands.dispatch(self, event)
        except RealtimeError as exc:
            if exc.event_id is None and isinstance(event.get("event_id"), str):
                exc.event_id = event["event_id"]
            raise

    def reserve_input_bytes(self, size: int) -> bool:
        """The socket read a ``size``-byte input frame: count it until handled, unless over the limit."""
        if self._pending_input_bytes + size > self.settings.max_pending_input_bytes:
            return False
        self._pending_input_bytes += size
        return True

    # ---------------------------------------------------------------- configuration

    def reconfigure(self, cfg: SessionConfig) -> None:
        """Apply a validated ``session.update`` (server VAD kept, rebuilt or dropped to match) and announce it."""
        self._cfg = cfg
        self._server_vad = sync_server_vad(self)
        self.emit("session.updated", session=self.session_object())

    # ---------------------------------------------------------------- the epoch

    def advance_epoch(self, reason: str) -> int:
        """The one place the epoch changes: bump it and fence every live stage stream at the new value.

        Units sent under the old epoch will never report a decision, so their send times are dropped.
        """
        self._epoch += 1
        self._unit_sent_at.clear()
        self.pipeline.interrupt(self._epoch, reason)
        return self._epoch

    def interrupt(self, reason: str, *, cleared: bool = False) -> None:
        """A hard interrupt (barge-in, cancel, clear, VAD turn): new epoch, and the active response cancelled."""
        self._interrupt_started = time.monotonic()
        self.advance_epoch(reason)
        self.lifecycle.cancel_active(reason, cleared=cleared)

    # ---------------------------------------------------------------- input and turns

    def buffered_input_bytes(self) -> int:
        """Bytes (as float32) of input audio still pending: uncommitted, committed but unsent, and sent to
        the thinker but not yet consumed by it (docs/protocol.md, Realtime input backpressure). A unit stops
        counting when the thinker reports its decision, not when the gateway queues it, so a client that sends
        faster than the model listens is refused instead of piling units up toward the thinker."""
        backlog = sum(len(item.units) for item in self._backlog)
        return (self.input.pending_samples + UNIT_SAMPLES * (backlog + self.units_in_flight)) * 4

    def input_resumed(self) -> None:
        """The client appended audio: its input clocks the model again, the silence clock stops."""
        self._input_final = False

    def accept_units(self, units: list[AudioUnit]) -> None:
        """Closed input units: straight to the model in the native lane, else held for the commit."""
        for unit in units:
            if self.cfg.auto_response:
                self.forward_unit(unit)
            else:
                self.input.hold([unit])

    def drop_input(self) -> None:
        """``input_audio_buffer.clear`` / ``input.cancel`` / barge-in: forget the uncommitted input."""
        self.input.clear()
        if self._server_vad is not None:
            self._server_vad.reset()

    def seal_input(
        self, *, create: bool, speech: bool, item_id: str | None = None, final: bool = False
    ) -> None:
        """Turn the uncommitted input into a user item (and, with ``create``, answer it): commit or server VAD.

        ``final`` (native lane): the client's input ends here, so from now on the session clocks the model
        itself with silent units while a response is active (:meth:`tick_clock`).
        """
        audio_samples, residual = self.input.flush()
        if residual is not None:
            self.accept_units([residual])
        if final and self.cfg.auto_response:
            self._input_final = True
            self._clock_units = 0
            self.tick_clock()
        self._turn_id += 1
        item = UserItem(
            item_id or ev.new_user_item_id(),
            self._turn_id,
            audio_samples * 1000 // 16_000,
            self.input.seal(),
            speech,
        )
        previous = self.conversation.add(item)
        self.lifecycle.supersede_all()
        deferred = bool(
            create and speech and self.lifecycle.active is not None and not self.cfg.auto_response
        )
        self.emit("conversation.item.added", previous_item_id=previous, item=item.to_json())
        self.emit("conversation.item.created", previous_item_id=previous, item=item.to_json())
        committed_event: dict[str, Any] = {
            "type": "input.committed",
            "turn_id": self._turn_id,
            "epoch": self._epoch,
            "history_len": len(self.conversation),
            "message": "speech" if speech else "silence_or_noise",
        }
        if deferred:
            committed_event["response_create_deferred"] = True
        self.emit(
            "input_audio_buffer.committed", previous_item_id=previous, item_id=item.id, event=committed_event
        )
        self.emit("conversation.item.done", item=item.to_json())
        if not speech:
            self.emit_listen("silence_or_noise")
            return
        if self.cfg.auto_response:
            return
        self._backlog.append(item)
        if create:
            if deferred:
                self.lifecycle.defer_create()
            else:
                self.lifecycle.start_turn_response()

    def take_backlog(self) -> list[AudioUnit]:
        """The units of every committed, unsent user item (turn lane), which the caller now sends to start a
        response; the function results that arrived go with its first unit."""
        units = [u for item in self._backlog for u in item.units]
        self._backlog.clear()
        self._tool_results_waiting = False
        return units

    def add_tool_output(self, call: FunctionCallItem, output: str) -> None:
        """``conversation.item.create`` of a ``function_call_output``: the item joins the conversation and the
        result goes to the model right before the next unit (as the chat template's tool message)."""
        item = FunctionCallOutputItem(ev.new_item_id(), call.call_id, output)
        previous = self.conversation.add(item)
        call.answered = True
        self._tool_outputs.append(output)
        self._tool_results_waiting = True
        self.emit("conversation.item.added", previous_item_id=previous, item=item.to_json())
        self.emit("conversation.item.created", previous_item_id=previous, item=item.to_json())
        self.emit("conversation.item.done", item=item.to_json())

    def emit_listen(
        self, reason: str, *, unit_seq: int | None = None, response_id: str | None = None
    ) -> None:
        """``response.listen``: the model (or the input) gives nothing to answer."""
        metadata: dict[str, Any] = {"reason": reason}
        if unit_seq is not None:
            metadata["unit_seq"] = unit_seq
        fields: dict[str, Any] = {"session_id": self.id, "epoch": self._epoch}
        if response_id is not None:
            fields["response_id"] = response_id
        fields["response"] = {"object": "realtime.response", "status": "listening", "metadata": metadata}
        self.emit("response.listen", **fields)

    def forward_unit(self, unit: AudioUnit, role: UnitRole = UnitRole.PLAIN) -> int:
        """Send one unit to the thinker under the current epoch; returns its session-wide unit index."""
        seq = self._unit_seq
        for output in self._tool_outputs:  # the pipeline sends them with the next unit it sends
            self.pipeline.add_tool_output(output)
        self._tool_outputs.clear()
        # Pushed first: a full queue toward the thinker refuses the unit (input_backpressure) before any
        # bookkeeping counts it.
        self.pipeline.push_unit(unit.samples, unit.frames, seq, self._epoch, self._turn_id, role)
        self._unit_seq += 1
        metrics.UNITS.inc()
        self._unit_sent_at[seq] = time.monotonic()
        return seq

    def tick_clock(self) -> None:
        """The native lane's silence clock: after a final commit, while a response is active and its model
        turn goes on, feed one 1 s silent unit each time the thinker has decided every unit sent so far,
        at most ``response_unit_cap`` of them (then the response ends, see ``ResponseLifecycle._on_unit``).

        Without it a native response would stall after the client's last unit, since a unit only runs
        when input arrives. Called after each pipeline event and at the final commit; any append stops it.
        """
        resp = self.lifecycle.active
        if not (self.cfg.auto_response and self._input_final) or resp is None or resp.thinker_turn_ended:
            return
        if self._unit_sent_at or self._clock_units >= self.response_unit_cap:
            return
        self._clock_units += 1
        self.forward_unit(self.silence_unit())

    def note_decision(self, unit_seq: int) -> None:
        """The thinker decided on ``unit_seq``: observe how long that took."""
        sent = self._unit_sent_at.pop(unit_seq, None)
        if sent is not None:
            metrics.UNIT_DECISION.observe(time.monotonic() - sent)

    def silence_unit(self) -> AudioUnit:
        return AudioUnit(-1, np.zeros(UNIT_SAMPLES, dtype=np.float32), [], False)

    def pending_commits(self) -> int:
        return len(self._backlog)
