"""The one driver of every stage's bidirectional ``Generate`` stream, and the one epoch rule.

Thinker, talker and code2wav streams share their skeleton: the ``open`` handshake, a task pumping the
client's requests into an inbox, the epoch fence, typed errors, the stream metrics and the clean-up when
the stream ends for whatever reason. :class:`StageStreamDriver` is that skeleton; a stage supplies only a
:class:`StageStream` per stream (what an open, a data message, an interrupt, an engine event and the end
mean to its engine).

**The epoch rule** (also in ``protos/minicpmo/v1/common.proto`` and docs/design.md), applied by
:class:`EpochFence` before the stage's handler sees a message:

1. a stream's epoch only increases; it starts at ``open.id.epoch``;
2. ``Control.interrupt(new_epoch)`` with ``new_epoch`` <= the current epoch changes nothing and is
   acknowledged with ``dropped_items = 0``;
3. an interrupt to a newer epoch moves the stream there: the handler drops the older epoch's queued and
   running work and the stage acknowledges with how much it dropped;
4. a data message (thinker unit, talker chunk, code2wav window) stamped with a newer epoch first applies
   that interrupt, acknowledged as in 3, and is then taken as the first message of its epoch;
5. a data message of an older epoch is dropped unseen and counted
   (``minicpmo_stage_stale_items_total``). A data message without an ``id`` belongs to the current epoch.

An ``InterruptAck`` echoes the epoch the interrupt asked for in ``new_epoch``; its ``id.epoch`` is the
epoch the stream is in after applying it.

**One task.** Requests, engine events and the handler's own work are handled by the stream's task in
order, so a handler needs no locks: the pump only moves requests into the inbox, engine threads post
events through :meth:`Inbox.post_threadsafe`. ``Control.end`` and a half-close both end the request
side (anything the client sends after ``end`` is not read); the handler then finishes its work and says
when it is done through :attr:`StageStream.finished`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from services.common.errors import FAILED_PRECONDITION, INTERNAL, INVALID_ARGUMENT, UNAVAILABLE, StageError
from services.common.metrics import ERRORS, INTERRUPTS, REQUESTS, STALE_ITEMS, STREAMS_ACTIVE
from services.common.pb import common_pb2

log = logging.getLogger(__name__)

RespT = TypeVar("RespT")
# Client requests read ahead of the stream's task at most; past that the pump stops reading and gRPC flow
# control pushes back on the client (engine events are not counted: the engine bounds its own output).
MAX_QUEUED_REQUESTS = 64
_HALF_CLOSE = object()  # the pump's last item: the client closed its side of the stream


class Admit(enum.Enum):
    """What the fence says about a data message's epoch."""

    CURRENT = "current"
    NEWER = "newer"  # apply the interrupt to its epoch first (rule 4)
    STALE = "stale"  # drop it (rule 5)


class EpochFence:
    """The epoch of one stream and the one rule every stage obeys (module docstring)."""

    def __init__(self, stage: str, epoch: int = 0) -> None:
        self.stage = stage
        self.epoch = int(epoch)
        self.stale = 0  # data messages of older epochs dropped on this stream

    def advance(self, new_epoch: int) -> bool:
        """Move to ``new_epoch`` when it is newer (True: the caller drops older work); else change nothing."""
        if int(new_epoch) <= self.epoch:
            return False
        self.epoch = int(new_epoch)
        return True

    def admit(self, epoch: int | None) -> Admit:
        """Classify a data message's epoch (None: it carries no id, so it is of the current epoch)."""
        if epoch is None or int(epoch) == self.epoch:
            return Admit.CURRENT
        if int(epoch) > self.epoch:
            return Admit.NEWER
        self.stale += 1
        STALE_ITEMS.labels(self.stage).inc()
        return Admit.STALE


@dataclass(frozen=True)
class Interrupted:
    """What a handler did for an advancing interrupt.

    ``dropped``: queued/running items dropped, acknowledged by the driver right away; None when the
    stage's engine applies the interrupt on its own thread and sends the ack itself, in order with its
    output (the talker). ``then``: responses that follow the ack (the thinker's turn ends with Done).
    """

    dropped: int | None
    then: Sequence[Any] = ()


class Inbox:
    """The stream's one queue: client requests, engine events, anything a handler posts to itself."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self.request_room = asyncio.Semaphore(MAX_QUEUED_REQUESTS)  # see MAX_QUEUED_REQUESTS

    def post(self, item: Any) -> None:
        """From the stream's event loop (an asyncio engine, a callback on the loop)."""
        self._queue.put_nowait(item)

    def post_threadsafe(self, item: Any) -> None:
        """From an engine thread; dropped silently once the event loop is gone (nobody left to read)."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    put_nowait = post  # so an asyncio engine that writes to a queue can write here instead

    async def get(self) -> Any:
        return await self._queue.get()

    def empty(self) -> bool:
        return self._queue.empty()


class StageStream(Generic[RespT]):
    """The per-stream part a stage supplies; the driver calls it from the stream's task only.

    Every ``on_*`` returns the responses to send (in order). Raising :class:`StageError` ends the stream
    with that typed error; setting :attr:`finished` ends it after the returned responses.
    """

    data_kind: str | None = None  # the request oneof field carrying data ("unit", "chunk", "window")
    finished: bool = False

    def identity(self) -> common_pb2.Identity:
        """Identity stamped on errors and acks the driver sends (its epoch is set by the driver)."""
        raise NotImplementedError

    async def start(self, inbox: Inbox) -> Sequence[RespT]:
        """Open the stream on the engine (may raise StageError: the stream ends before it starts)."""
        return ()

    async def on_data(self, data: Any) -> Sequence[RespT]:
        """A data message of the current epoch."""
        raise StageError(INVALID_ARGUMENT, f"unexpected {self.data_kind} message", self.data_kind or "kind")

    async def on_interrupt(self, new_epoch: int) -> Interrupted:
        """The fence moved to ``new_epoch``: drop everything of older epochs."""
        raise NotImplementedError

    async def on_flush(self) -> Sequence[RespT]:
        return ()

    async def on_end(self) -> Sequence[RespT]:
        """``Control.end`` or half-close: no more input; finish the work and set :attr:`finished`."""
        return ()

    async def on_event(self, event: Any) -> Sequence[RespT]:
        """Something the engine (or the handler itself) posted to the inbox."""
        return ()

    async def advance(self) -> Sequence[RespT]:
        """Work the handler starts on its own (the next queued unit, the final Done); called whenever the
        inbox is empty, i.e. after every request and event that had arrived was handled."""
        return ()

    def on_unexpected(self, kind: str | None) -> Sequence[RespT]:
        """A request kind the stage does not take after open (default: a typed error ending the stream)."""
        if kind == "open":
            raise StageError(FAILED_PRECONDITION, "stream is already open", "open")
        raise StageError(INVALID_ARGUMENT, f"unexpected {kind} message after open", "kind")

    async def close(self) -> None:
        """The stream is over (finished, failed, cancelled or the client left): free engine state."""


class StageStreamDriver(Generic[RespT]):
    """Runs ``Generate`` streams of one stage: the handshake, the pump, the fence, errors and metrics.

    ``make_stream(open_msg)`` builds the per-stream handler. ``draining`` (set by a stage's drain hook)
    refuses new streams with UNAVAILABLE while open ones finish.
    """

    def __init__(
        self,
        stage: str,
        request_cls: type,
        response_cls: Callable[..., RespT],
        make_stream: Callable[[Any], StageStream[RespT]],
        missing_open_code: int = INVALID_ARGUMENT,
    ) -> None:
        self.stage = stage
        self.request_cls = request_cls
        self.response_cls = response_cls
        self.make_stream = make_stream
        self.missing_open_code = missing_open_code
        self.draining = False

    def error(self, err: StageError, identity: common_pb2.Identity | None) -> RespT:
        ERRORS.labels(self.stage, err.code_name).inc()
        return self.response_cls(error=err.to_proto(identity))

    def _count(self, msg: RespT) -> RespT:
        if msg.WhichOneof("kind") == "error":  # type: ignore[attr-defined]
            ERRORS.labels(self.stage, StageError.from_proto(msg.error).code_name).inc()  # type: ignore[attr-defined]
        return msg

    async def generate(self, request_iterator: AsyncIterator[Any]) -> AsyncIterator[RespT]:
        """The body of a stage's ``Generate`` method."""
        REQUESTS.labels(self.stage).inc()
        requests = aiter(request_iterator)
        try:
            first = await anext(requests)
        except StopAsyncIteration:
            return
        if first.WhichOneof("kind") != "open":
            open_name = type(first).__name__.replace("Request", "Open")
            message = f"the first message of a {self.stage} stream must be {open_name}"
            yield self.error(StageError(self.missing_open_code, message, "open"), None)
            return
        open_msg = first.open
        if self.draining:
            err = StageError(UNAVAILABLE, f"{self.stage} is draining; retry on another replica")
            yield self.error(err, open_msg.id)
            return
        STREAMS_ACTIVE.labels(self.stage).inc()
        inbox = Inbox()
        reader: asyncio.Task[None] | None = None
        stream: StageStream[RespT] | None = None
        try:
            stream = self.make_stream(open_msg)
            for msg in await stream.start(inbox):
                yield self._count(msg)
            reader = asyncio.create_task(self._pump(requests, inbox))
            run = _StreamRun(EpochFence(self.stage, int(open_msg.id.epoch)))
            async for msg in self._run(stream, run, inbox):
                yield self._count(msg)
        except StageError as err:
            yield self.error(err, stream.identity() if stream is not None else open_msg.id)
        except Exception as exc:  # a handler bug: typed INTERNAL on the stream, never a bare gRPC failure
            log.exception("%s stream failed", self.stage)
            internal = StageError(
                INTERNAL, f"{self.stage} failed on this stream ({type(exc).__name__}); see server log"
            )
            yield self.error(internal, stream.identity() if stream is not None else open_msg.id)
        finally:
            if reader is not None:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await reader
            if stream is not None:
                await stream.close()
            STREAMS_ACTIVE.labels(self.stage).dec()

    async def _pump(self, requests: AsyncIterator[Any], inbox: Inbox) -> None:
        """Move the client's requests into the inbox until it half-closes or sends ``Control.end``."""
        try:
            async for req in requests:
                await inbox.request_room.acquire()
                inbox.post(req)
                if req.WhichOneof("kind") == "control" and req.control.WhichOneof("kind") == "end":
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a broken client stream ends the request side like a half-close
            log.warning("%s request stream failed: %s", self.stage, exc)
        inbox.post(_HALF_CLOSE)

    async def _run(self, stream: StageStream[RespT], run: _StreamRun, inbox: Inbox) -> AsyncIterator[RespT]:
        ended = False
        while not stream.finished:
            if inbox.empty():
                for msg in await stream.advance():
                    yield msg
                if stream.finished:
                    return
            item = await inbox.get()
            if item is _HALF_CLOSE:
                out = () if ended else await stream.on_end()
                ended = True
            elif isinstance(item, self.request_cls):
                inbox.request_room.release()
                if ended:
                    continue  # after Control.end nothing more of the client's is read
                out = await self._request(stream, run, item)
                ended = ended or _is_end(item)
            else:
                out = await stream.on_event(item)
            for msg in out:
                for sent in run.release(msg):
                    yield sent

    async def _request(self, stream: StageStream[RespT], run: _StreamRun, req: Any) -> Sequence[RespT]:
        kind = req.WhichOneof("kind")
        if kind == "control":
            which = req.control.WhichOneof("kind")
            if which == "interrupt":
                return await self._interrupt(stream, run, int(req.control.interrupt.new_epoch))
            if which == "flush":
                return await stream.on_flush()
            if which == "end":
                return await stream.on_end()
            return ()
        if kind is not None and kind == stream.data_kind:
            data = getattr(req, kind)
            verdict = run.fence.admit(data.id.epoch if data.HasField("id") else None)
            if verdict is Admit.STALE:
                return ()
            out: list[RespT] = []
            if verdict is Admit.NEWER:
                out.extend(await self._interrupt(stream, run, int(data.id.epoch)))
            out.extend(await stream.on_data(data))
            return out
        return stream.on_unexpected(kind)

    async def _interrupt(self, stream: StageStream[RespT], run: _StreamRun, new_epoch: int) -> list[RespT]:
        if not run.fence.advance(new_epoch):
            return run.hold([self._ack(stream, run.fence, new_epoch, 0)])
        INTERRUPTS.labels(self.stage).inc()
        applied = await stream.on_interrupt(new_epoch)
        if applied.dropped is None:
            run.engine_acks_due += 1
            return list(applied.then)
        return [self._ack(stream, run.fence, new_epoch, applied.dropped), *applied.then]

    def _ack(self, stream: StageStream[RespT], fence: EpochFence, new_epoch: int, dropped: int) -> RespT:
        ident = stream.identity()
        ident.epoch = fence.epoch
        ack = common_pb2.InterruptAck(id=ident, new_epoch=new_epoch, dropped_items=dropped)
        return self.response_cls(interrupt_ack=ack)


@dataclass
class _StreamRun:
    """The driver's state of one stream: its fence, and acks kept in the order of their interrupts.

    When the engine acknowledges an interrupt itself (``Interrupted(dropped=None)``), the ack of a later
    non-advancing interrupt waits until the engine's ack went out, so acks always follow the interrupts'
    order on the wire.
    """

    fence: EpochFence
    engine_acks_due: int = 0
    held: list[Any] = field(default_factory=list)

    def hold(self, acks: list[Any]) -> list[Any]:
        if self.engine_acks_due:
            self.held.extend(acks)
            return []
        return acks

    def release(self, msg: Any) -> list[Any]:
        if self.engine_acks_due and msg.WhichOneof("kind") == "interrupt_ack":
            self.engine_acks_due -= 1
            if not self.engine_acks_due:
                held, self.held = self.held, []
                return [msg, *held]
        return [msg]


class StageServicer:
    """The two RPCs every stage servicer answers the same way; mixed in before the generated base class.

    A servicer sets ``info`` (its ``StageInfo``) and ``driver`` (its :class:`StageStreamDriver`).
    """

    info: common_pb2.StageInfo
    driver: StageStreamDriver[Any]

    async def GetInfo(self, request: common_pb2.GetInfoRequest, context: Any) -> common_pb2.StageInfo:  # noqa: N802
        return self.info

    async def Generate(self, request_iterator: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:  # noqa: N802
        async for msg in self.driver.generate(request_iterator):
            yield msg


def _is_end(req: Any) -> bool:
    return bool(req.WhichOneof("kind") == "control" and req.control.WhichOneof("kind") == "end")
