"""The duplex stream of the thinker: one persistent session fed one 1 s unit at a time.

:class:`DuplexStream` is the thinker's per-stream part of :mod:`services.common.stage_stream` in duplex
mode; what a unit means to the model (its tokens, embeddings, policy and results) is
:class:`~services.thinker.duplex.DuplexSession`'s. The stream owns the scheduling:

* the session prefix is prefilled once at open into a persistent engine sequence;
* units queue in arrival order. The oldest queued unit goes to the backend's
  :class:`~services.thinker.duplex_encode.DuplexUnitEncoder` (mel, Whisper rows, frames, batched with
  every other session's waiting unit on the encode executor) **while the engine still decodes the unit
  before it** (encode-ahead: its audio does not depend on that unit's decision, so the encode is off the
  unit-to-unit critical path); once the previous unit's decision is in, the encoded unit is assembled
  (token layout, embeddings, policy) and goes to the engine (:meth:`DuplexStream.advance`).
  it is the default (tests compare it with encoding after the decision through :data:`ENCODE_AHEAD`);
* with ``--duplex-window basic`` a unit that would pass the window's high mark first replaces the
  sequence with a trimmed one (prefix + newest units) and follows that prefill. The mark is lowered to
  the session's share of the KV pool (:meth:`~services.thinker.engine.ThinkerEngine.session_share`),
  so open sessions never hold more than the pool; a session whose share cannot hold its prefix plus
  ``MIN_ROOM_TOKENS`` is refused at open, and one past its share without a window ends with
  ``RESOURCE_EXHAUSTED``;
* an interrupt to a newer epoch (the fence is the driver's) cancels the running unit, drops the queued
  ones and acknowledges how many; a unit that finishes just before the interrupt is applied is dropped.
  A dropped unit that was already encoded ahead leaves its audio in the session's streaming encoder
  cache (left context of the next unit, as audio the session did hear), never in the model's context;
* ``End`` or half-close lets the queued units finish, then ``Done`` carries the session's usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import Counter

from services.common.errors import CONTEXT_LENGTH_EXCEEDED, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, StageError
from services.common.metrics import INTERRUPT_DRAIN
from services.common.pb import common_pb2, thinker_pb2
from services.common.stage_stream import Inbox, Interrupted, StageStream
from services.thinker.backend import ThinkerBackend
from services.thinker.duplex import UNIT_PHASE_SECONDS, DuplexSession, EncodedAudio, UnitOutcome
from services.thinker.duplex_encode import DuplexUnitEncoder
from services.thinker.duplex_policy import MAX_TOKENS_PER_UNIT
from services.thinker.duplex_window import MIN_ROOM_TOKENS, ContextRecord
from services.thinker.engine import STAGE, EngineEvent, Sink
from services.thinker.errors import failure
from services.thinker.scheduler import Sequence as EngineSequence
from services.thinker.scheduler import WorkItem

log = logging.getLogger(__name__)

WINDOW_TRIMS = Counter(
    "minicpmo_thinker_duplex_window_trims_total",
    "Duplex sessions' context trims by the sliding window (--duplex-window basic)",
)
Response = thinker_pb2.ThinkerResponse
ENCODE_AHEAD = True  # False: encode a unit only after the previous decision (the tests' other arm)


@dataclass
class AheadEncode:
    """The oldest queued unit, being encoded while the engine decides the unit before it."""

    unit: thinker_pb2.ThinkerUnit
    started: float  # perf_counter when its encode began
    task: asyncio.Task[EncodedAudio]
    done_at: float = 0.0  # perf_counter when its encode ended (set by the task)


@dataclass
class RunningUnit:
    unit_seq: int
    epoch: int
    outcome: UnitOutcome
    submitted: float  # perf_counter when it went to the engine
    context_before: int = 0  # the session's context when it was submitted (held in the KV)
    requested: bool = False  # see EncodedUnit.requested


UNIT_PERIOD_S = 1.0  # a unit is 1 s of audio: its decision is due before the next one arrives


@dataclass
class EncodedUnit:
    """A unit encoded and waiting for the engine (behind a window trim's prefill, when deferred)."""

    unit_seq: int
    work: WorkItem
    started: float  # perf_counter when its encode began
    encoded_at: float  # perf_counter when its encode ended: from here it waits for the previous decision
    requested: bool = False  # the unit asks for a response (a commit): its time is on the first-audio path


class DuplexStream(StageStream[Response]):
    data_kind = "unit"

    def __init__(self, backend: ThinkerBackend, open_msg: thinker_pb2.ThinkerOpen) -> None:
        self.backend = backend
        self.engine = backend.engine
        self.open_msg = open_msg
        self.session: DuplexSession | None = None
        if backend.duplex_encoder is None:  # one per backend: it batches the units of all its sessions
            backend.duplex_encoder = DuplexUnitEncoder(backend)
        self.encoder: DuplexUnitEncoder = backend.duplex_encoder
        self.seq: EngineSequence | None = None
        # The inbox's thread-safe post, for the engine sequence (and a trimmed one).
        self.sink: Sink | None = None
        self.record: ContextRecord | None = None
        self.pending: list[tuple[thinker_pb2.ThinkerUnit, float]] = []  # (unit, arrival time)
        self.current: RunningUnit | None = None
        self.deferred: EncodedUnit | None = None  # a unit waiting for a window trim's prefill
        self.ahead: AheadEncode | None = None  # the oldest queued unit, encoding while the engine runs
        self.dropped_ahead: asyncio.Task[EncodedAudio] | None = None  # an interrupt dropped its unit
        self.busy = True  # the engine computes something of this session (the prefix at first)
        self.ending = False
        self.context_tokens = 0
        self.cached_tokens = 0  # prompt tokens of this session's prefills found in the prefix cache

    def identity(self) -> common_pb2.Identity:
        if self.session is not None:
            return self.session.ident()
        ident = common_pb2.Identity()
        ident.CopyFrom(self.open_msg.id)
        return ident

    async def start(self, inbox: Inbox) -> Sequence[Response]:
        """Build and prefill the session prefix (instructions, reference voice rows, seeded text)."""
        loop = asyncio.get_running_loop()
        try:
            session = DuplexSession(self.backend, self.open_msg)
            prefix = await loop.run_in_executor(self.backend.executor, session.prefix_work)
            self.engine.check_prompt_length(len(prefix.token_ids) + MAX_TOKENS_PER_UNIT, "instructions")
        except StageError:
            raise
        except Exception as exc:
            log.exception("duplex session setup failed")
            raise failure("duplex setup failed", exc) from exc
        self.session = session
        self.sink = inbox.post_threadsafe
        self.seq = self.engine.open(self.sink, persistent=True)
        share, need = self.engine.session_share(), len(prefix.token_ids) + MIN_ROOM_TOKENS
        if share < need:
            self.engine.close(self.seq)
            self.seq = None
            raise StageError(
                RESOURCE_EXHAUSTED,
                f"the thinker's KV cache has no room for another duplex session: with "
                f"{self.engine.open_sessions + 1} open each may hold {share} tokens, and this one needs "
                f"{need} (its {len(prefix.token_ids)}-token prefix and {MIN_ROOM_TOKENS} more)",
                "session",
            )
        self.engine.submit(self.seq, prefix)
        if self.backend.duplex_window is not None:
            self.record = ContextRecord(self.backend.duplex_window, self.engine.runner.model.embed_tokens)
            self.record.record(0, prefix, prefix=True)
        return ()

    async def on_data(self, unit: thinker_pb2.ThinkerUnit) -> Sequence[Response]:
        self.pending.append((unit, time.perf_counter()))
        return ()

    async def on_interrupt(self, new_epoch: int) -> Interrupted:
        assert self.session is not None and self.seq is not None
        running = self.current is not None or self.deferred is not None
        dropped = len(self.pending) + (1 if running else 0)
        self.pending.clear()
        self.deferred = None  # a unit waiting for a window trim belongs to the old epoch
        if self.ahead is not None:  # its encode finishes (the session's encoder state moves on), unused
            self.dropped_ahead, self.ahead = self.ahead.task, None
        if self.current is not None:
            self.engine.cancel(self.seq)  # the engine records the drain of the running unit
        else:
            INTERRUPT_DRAIN.labels(STAGE).observe(0.0)  # nothing of the old epoch running
        self.session.after_interrupt(new_epoch)
        return Interrupted(dropped)

    async def on_end(self) -> Sequence[Response]:
        self.ending = True
        return ()

    def on_unexpected(self, kind: str | None) -> Sequence[Response]:
        if kind == "open":
            return super().on_unexpected(kind)
        raise StageError(INVALID_ARGUMENT, "a duplex stream accepts units and controls after open", "open")

    async def advance(self) -> Sequence[Response]:
        if not self.busy and self.pending:
            return await self._start_next_unit()
        self._maybe_encode_ahead()
        if self.ending and not self.busy and not self.pending:
            self.finished = True
            return [self._done()]
        return ()

    def _maybe_encode_ahead(self) -> None:
        """Start encoding the oldest queued unit now, while the engine still runs the one before it."""
        session = self.session
        if not (ENCODE_AHEAD and self.busy and self.pending and self.ahead is None and session is not None):
            return
        unit = self.pending[0][0]
        previous = self.dropped_ahead
        self.dropped_ahead = None

        async def encode() -> EncodedAudio:
            if previous is not None:  # a session's units go through its encoder one after another
                with contextlib.suppress(BaseException):
                    await previous
            started = time.perf_counter()
            encoded = await self.encoder.encode(session, unit)
            ahead.done_at = time.perf_counter()
            UNIT_PHASE_SECONDS.labels("encode").observe(ahead.done_at - started)
            return encoded

        ahead = AheadEncode(unit, time.perf_counter(), asyncio.ensure_future(encode()))
        self.ahead = ahead

    async def _encoded(self, unit: thinker_pb2.ThinkerUnit) -> tuple[EncodedAudio, float, float]:
        """The unit's encoder rows (from its encode-ahead, or encoded now), when its encode began and when
        it ended."""
        session = self.session
        assert session is not None
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead.unit is unit:
            return await ahead.task, ahead.started, ahead.done_at
        if self.dropped_ahead is not None:  # wait for a dropped unit's encode: the encoder state is serial
            with contextlib.suppress(BaseException):
                await self.dropped_ahead
            self.dropped_ahead = None
        started = time.perf_counter()
        encoded = await self.encoder.encode(session, unit)
        done = time.perf_counter()
        UNIT_PHASE_SECONDS.labels("encode").observe(done - started)
        return encoded, started, done

    async def _start_next_unit(self) -> Sequence[Response]:
        """Assemble the oldest queued unit (encoded ahead, or now) and hand it to the engine (after a window
        trim if one is due)."""
        session = self.session
        assert session is not None and self.seq is not None
        unit, arrived = self.pending.pop(0)
        unit_seq = int(unit.id.unit_seq) if unit.HasField("id") else session.units_done
        force_speak = bool(self.open_msg.force_speak or unit.request_response)
        try:
            encoded, started, encoded_at = await self._encoded(unit)
            UNIT_PHASE_SECONDS.labels("queued").observe(max(0.0, started - arrived))
            work = session.assemble_unit(encoded, force_speak)
        except StageError as err:
            return self._fail(err, unit_seq)
        except Exception as exc:  # an encoder failure (e.g. out of memory) ends the stream typed
            log.exception("duplex unit encode failed")
            return self._fail(failure("duplex unit encode failed", exc), unit_seq)
        work.deadline = arrived + UNIT_PERIOD_S  # the engine serves the unit closest to an underrun first
        encoded_unit = EncodedUnit(unit_seq, work, started, encoded_at, bool(unit.request_response))
        if await self._trim_window(encoded_unit):
            return ()
        # A unit that may make a function call can decode a whole call past the unit's 19 tokens.
        new_tokens = max(MAX_TOKENS_PER_UNIT, work.sampler.reserve_tokens if work.sampler else 0)
        if self.context_tokens + len(work.token_ids) + new_tokens > self.engine.max_context:
            too_long = StageError(
                CONTEXT_LENGTH_EXCEEDED,
                f"duplex session context {self.context_tokens} + unit would pass {self.engine.max_context} tokens",
                "unit",
            )
            return self._fail(too_long, unit_seq)
        share = self.engine.session_share()
        if self.context_tokens + len(work.token_ids) + new_tokens > share:
            over = StageError(
                RESOURCE_EXHAUSTED,
                f"duplex session context {self.context_tokens} + unit would pass its share of the thinker's "
                f"KV cache ({share} tokens with {self.engine.open_sessions} sessions open)"
                + ("" if self.record is not None else "; --duplex-window basic would trim it instead"),
                "unit",
            )
            return self._fail(over, unit_seq)
        self._submit(encoded_unit, self.context_tokens)
        self._maybe_encode_ahead()
        return ()

    async def _trim_window(self, encoded: EncodedUnit) -> bool:
        """With a sliding window due: a fresh sequence (prefix + newest units); the unit follows its prefill."""
        record, session = self.record, self.session
        assert session is not None and self.seq is not None and self.sink is not None
        # A unit that may make a function call needs room for the whole call, not only its 19 tokens.
        sampler = encoded.work.sampler
        incoming = len(encoded.work.token_ids) + max(
            0, (sampler.reserve_tokens if sampler else 0) - MAX_TOKENS_PER_UNIT
        )
        if record is None:
            return False
        window = record.window.within(self.engine.session_share())  # the pool's share binds first
        if not record.needs_trim(self.context_tokens, incoming, window):
            return False
        loop = asyncio.get_running_loop()
        trim = await loop.run_in_executor(
            self.backend.executor, record.trimmed, list(self.seq.tokens), incoming, window
        )
        if trim is None:
            return False
        self.engine.close(self.seq)
        self.seq = self.engine.open(self.sink, persistent=True)
        trim.tag = ("trim", session.epoch)
        self.engine.submit(self.seq, trim)
        WINDOW_TRIMS.inc()
        log.info(
            "duplex session %s: context %d -> %d tokens (window trim)",
            session.identity.session_id,
            self.context_tokens,
            len(trim.token_ids),
        )
        self.deferred = encoded
        self.busy = True
        session.tools_noted = []  # the tools note may have been trimmed away: the next unit places it again
        self._maybe_encode_ahead()
        return True

    def _submit(self, encoded: EncodedUnit, start: int) -> None:
        session = self.session
        assert session is not None and self.seq is not None
        encoded.work.tag = (encoded.unit_seq, session.epoch)
        submitted = time.perf_counter()
        behind = max(0.0, submitted - encoded.encoded_at)
        UNIT_PHASE_SECONDS.labels("behind").observe(behind)
        if encoded.requested:
            UNIT_PHASE_SECONDS.labels("request_behind").observe(behind)
        if self.record is not None:
            self.record.record(start, encoded.work)
        self.engine.submit(self.seq, encoded.work)
        self.current = RunningUnit(
            encoded.unit_seq, session.epoch, UnitOutcome(), submitted, start, requested=encoded.requested
        )
        self.busy = True

    def _fail(self, err: StageError, unit_seq: int) -> list[Response]:
        assert self.session is not None
        self.finished = True
        return [Response(error=err.to_proto(self.session.ident(unit_seq)))]

    def _done(self) -> Response:
        session = self.session
        assert session is not None
        record = self.record
        fed = self.context_tokens + (record.dropped_tokens if record is not None else 0)
        usage = common_pb2.Usage(
            prompt_tokens=fed - session.total_generated,
            completion_tokens=session.total_generated,
            total_tokens=fed,
            cached_tokens=self.cached_tokens,
        )
        usage.extra["units"] = session.units_done
        if record is not None:
            usage.extra["window_trims"] = record.trims
        return Response(done=common_pb2.Done(id=session.ident(), finish_reason="stop", usage=usage))

    async def on_event(self, ev: EngineEvent) -> Sequence[Response]:
        session = self.session
        assert session is not None
        self.context_tokens = ev.context_tokens
        if ev.error is not None:
            raise ev.error
        if ev.finish_reason == "prefilled":
            self.cached_tokens += ev.cached_tokens  # a prefix (or trimmed re-prefill) found in the cache
        if ev.finish_reason == "prefilled" and self.deferred is not None:
            deferred, self.deferred = self.deferred, None
            self._submit(deferred, ev.context_tokens)
            return ()
        if ev.finish_reason in ("prefilled", "cancelled"):
            self.busy, self.current = False, None
            return ()
        current = self.current
        if current is None:
            return ()  # late event of a cancelled unit
        current.outcome.absorb(ev)
        if ev.finish_reason is None:
            return ()
        engine_s = time.perf_counter() - current.submitted
        UNIT_PHASE_SECONDS.labels("engine").observe(engine_s)
        if current.requested:
            UNIT_PHASE_SECONDS.labels("request_engine").observe(engine_s)
        self.busy, self.current = False, None
        if current.epoch < session.epoch:
            return ()  # finished just before an interrupt was applied: drop its output
        responses = session.unit_responses(current.unit_seq, current.outcome, self.context_tokens)
        for r in responses:
            if r.HasField("unit"):
                r.unit.context_before = current.context_before
        return responses

    async def close(self) -> None:
        """Stop the session's queued encodes, free its KV and give its Whisper cache slot back now (147 MB
        at full size), not whenever the last reference to the session happens to go."""
        for task in (self.ahead.task if self.ahead is not None else None, self.dropped_ahead):
            if task is not None:
                task.cancel()
        if self.seq is not None:
            self.engine.close(self.seq)
        if self.session is not None:
            self.session.audio_state.release()
