"""One duplex session: the state machine behind a realtime socket (wire-protocol §4.4–4.10).

Everything that changes session state runs on one asyncio task per session (the mailbox loop): client
commands, pipeline outputs and (re)attachments are processed strictly in arrival order, so outbound
event order, epochs and the journal never race. Sockets only read frames into the mailbox and drain
their outbound queue.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.realtime import events as ev
from gateway.realtime import metrics
from gateway.realtime.audio import UNIT_SAMPLES, AudioUnit, UnitAssembler
from gateway.realtime.config import SessionConfig, render_session
from gateway.realtime.errors import RealtimeError
from gateway.realtime.journal import EventJournal
from gateway.realtime.lifecycle import ResponseLifecycle
from gateway.realtime.server_vad import ServerVadTurns, sync_server_vad
from gateway.realtime.settings import RealtimeSettings

if TYPE_CHECKING:
    from gateway.duplex_pipeline import PipelineEvent, SessionPipeline

log = logging.getLogger(__name__)

CLOSE = object()  # outbound sentinel: close the socket after draining


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Attachment:
    """One socket's view of a session: an outbound queue drained by the socket's writer task."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.close_code: int | None = None
        self.detached = False

    def send(self, event: dict[str, Any]) -> None:
        if not self.detached:
            self.queue.put_nowait(event)

    def close(self, code: int = 1000) -> None:
        if not self.detached:
            self.detached = True
            self.close_code = code
            self.queue.put_nowait(CLOSE)


@dataclass
class UserItem:
    id: str
    turn_id: int
    audio_ms: int
    units: list[AudioUnit]
    has_speech: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_audio", "transcript": None, "audio_ms": self.audio_ms}],
        }


class DuplexSession:
    def __init__(
        self,
        settings: RealtimeSettings,
        cfg: SessionConfig,
        pipeline_factory: Callable[[DuplexSession], SessionPipeline],
        on_finished: Callable[[DuplexSession], None],
    ) -> None:
        self.settings = settings
        self.cfg = cfg
        self.id = ev.new_session_id()
        self.state = "open"
        self.epoch = 0
        self.turn_id = 0
        self.generation = 1
        self.resume_token: str | None = None
        self.resume_token_hash: str | None = None
        self.journal = EventJournal(ttl_s=settings.journal_ttl_s, max_bytes=settings.journal_max_bytes)
        self.attachment: Attachment | None = None
        self.mailbox: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.pending_input_bytes = 0
        self.assembler = UnitAssembler()
        self.audio_started = False
        self.input_has_audio = False
        self.input_has_speech = False
        self.input_units: list[AudioUnit] = []  # closed units of the uncommitted user item
        self.committed_backlog: list[UserItem] = []  # turn lane: committed but not yet sent to the model
        self.items: dict[str, dict[str, Any]] = {}
        self.item_order: list[str] = []
        self.last_item_id: str | None = None
        self.unit_seq = 0  # next unit index sent to the thinker
        self.pipeline = pipeline_factory(self)
        self.lifecycle = ResponseLifecycle(self)
        self._on_finished = on_finished
        self._task: asyncio.Task[None] | None = None
        self._grace_task: asyncio.Task[None] | None = None
        self.stage_acks: list[dict[str, Any]] = []
        self.interrupt_started: float | None = None
        self.unit_sent_at: dict[int, float] = {}  # unit_seq -> when it went to the thinker (metrics)  # monotonic time of the last hard interrupt
        self.input_samples = 0  # 16 kHz samples appended this session: the server-VAD audio clock
        self.server_vad: ServerVadTurns | None = None
        self.server_vad = sync_server_vad(self)
        if settings.supports_session_resume:
            self.rotate_token()

    # ---------------------------------------------------------------- plumbing

    def rotate_token(self) -> str:
        self.resume_token = secrets.token_urlsafe(32)
        self.resume_token_hash = hash_token(self.resume_token)
        return self.resume_token

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"realtime-session-{self.id}")

    def post(self, kind: str, payload: Any) -> None:
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
        playback = last.playback() if last else {"generated_ms": 0, "sent_ms": 0, "played_ms": 0, "committed_ms": 0}
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
            fields["resume_token"] = self.resume_token
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
                        self._do_detach(payload)
                    elif kind == "close":
                        await self._close(payload)
                    elif kind == "reject":
                        self.emit_error(payload)
                    elif kind == "expire":
                        self._expire(payload)
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
                await self._close("server_shutdown" if cancelled else "internal_error")
            await self._close_pipeline()
            self._on_finished(self)

    async def _close_pipeline(self) -> None:
        """Stop the stage streams, within ``pipeline_close_timeout_s`` and without raising.

        Session teardown must not depend on the stages: ``session.closed`` follows this however the
        pipeline's close ends (the gRPC pipeline cancels its calls first, so it normally takes
        milliseconds).
        """
        try:
            async with asyncio.timeout(self.settings.pipeline_close_timeout_s):
                await self.pipeline.close()
        except TimeoutError:
            log.warning("realtime session %s: pipeline close took over %.1f s; closing the session anyway",
                        self.id, self.settings.pipeline_close_timeout_s)
        except Exception:
            log.exception("realtime session %s: pipeline close failed; closing the session anyway", self.id)

    async def _close(self, reason: str, *, terminal_type: str = "session.closed") -> None:
        """End the session: abort the response (no cancelled ``response.done``, §4.10), free the stages,
        then ``session.closed`` and socket close 1000 — the last two unconditionally, so that a client's
        ``session.close`` is always answered in bounded time."""
        if self.state != "open":
            return
        self.state = "closed"
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

    def _do_detach(self, attachment: Attachment) -> None:
        """The socket went away: keep the session for the grace period if it can be resumed."""
        if attachment is not self.attachment:
            return
        attachment.detached = True
        self.attachment = None
        if not self.settings.supports_session_resume:
            self.post("close", "client_disconnected")
            return
        self._grace_task = asyncio.create_task(self._grace_expiry(self.generation))

    async def _grace_expiry(self, generation: int) -> None:
        await asyncio.sleep(self.settings.disconnect_grace_s)
        self.post("expire", generation)

    def _expire(self, generation: int) -> None:
        """Grace elapsed with no socket: the session ends with session.expired (journaled, unseen)."""
        if self.attachment is not None or self.generation != generation or self.state != "open":
            return
        self.lifecycle.abort_silently()
        self.emit("session.expired", session_id=self.id, reason="disconnect_grace_expired")
        self.state = "expired"

    def _do_resume(self, attachment: Attachment, last_seq: int, token_hash: str, done: asyncio.Future[None]) -> None:
        """Activate a new socket: replace the old one, announce, replay the journal (all atomically)."""
        if token_hash != self.resume_token_hash:
            # Another socket resumed with the same token first and rotated it.
            if not done.done():
                done.set_exception(RealtimeError("session_resume_conflict", "the session was resumed concurrently"))
            return
        if self._grace_task is not None:
            self._grace_task.cancel()
            self._grace_task = None
        self.generation += 1
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
            self.emit("session.resync_required", journaled=False, session_id=self.id, reason=plan.resync_reason)
        else:
            for event in plan.events:
                attachment.send(event)
        if not done.done():
            done.set_result(None)

    # ---------------------------------------------------------------- client commands

    async def _handle_client(self, event: dict[str, Any], raw_size: int) -> None:
        self.pending_input_bytes = max(0, self.pending_input_bytes - raw_size)
        from gateway.realtime.commands import dispatch  # local: commands imports this module

        try:
            await dispatch(self, event)
        except RealtimeError as exc:
            if exc.event_id is None and isinstance(event.get("event_id"), str):
                exc.event_id = event["event_id"]
            raise

    # ---------------------------------------------------------------- input helpers used by commands

    def is_speech(self, event: dict[str, Any], samples: np.ndarray) -> bool:
        for key in ("is_speech", "speech"):
            if isinstance(event.get(key), bool):
                return event[key]
        prob = event.get("speech_probability")
        vad = event.get("vad")
        if prob is None and isinstance(vad, dict):
            prob = vad.get("speech_probability")
        if isinstance(prob, (int, float)) and not isinstance(prob, bool):
            return prob >= 0.5
        from gateway.realtime.audio import rms

        return rms(samples) >= self.settings.overlap_silence_rms

    def forward_unit(self, unit: AudioUnit, *, request_response: bool = False) -> int:
        """Send one unit to the thinker under the current epoch; returns its session-wide unit index."""
        seq = self.unit_seq
        self.unit_seq += 1
        metrics.UNITS.inc()
        self.unit_sent_at[seq] = time.monotonic()
        self.pipeline.push_unit(unit.samples, unit.frames, seq, self.epoch, self.turn_id, request_response)
        return seq

    def silence_unit(self) -> AudioUnit:
        return AudioUnit(-1, np.zeros(UNIT_SAMPLES, dtype=np.float32), [], False)

    def pending_commits(self) -> int:
        return len(self.committed_backlog)

    def now(self) -> float:
        return time.monotonic()
