"""A bidi ``Generate`` call to one stage, with one replay-on-UNAVAILABLE retry before its first output.

Until the stage has produced its first response the stream remembers what it wrote; if the call then
fails as UNAVAILABLE (replica down or gone) it is re-opened on another replica (or the same one, when it
is alone) and the writes are replayed. After the first response nothing is replayed, because output
already left. The health monitor can also end a stream from outside (:meth:`StageStream.fail`), for a
stage that stopped answering without closing its connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc
from google.protobuf.message import Message

from gateway.metrics import STAGE_RETRIES
from gateway.replica import Replica
from gateway.stage_failure import StageFailure

log = logging.getLogger(__name__)


async def write_or_end(call: Any, msg: Message) -> None:
    """``call.write(msg)``, but raising InvalidStateError if the call ends while the write is pending.

    grpc.aio's write first waits for the call's initial metadata to be sent, and a call that fails before
    that (a reconnect to a stage that just died) never signals it: the write would wait until the call's
    deadline although the call is already over. Racing the write against the call's end makes it fail
    like a write to any ended call."""
    if call.done():
        raise asyncio.InvalidStateError("the call already ended")
    writing = asyncio.ensure_future(call.write(msg))
    ended = asyncio.ensure_future(call.code())
    try:
        await asyncio.wait((writing, ended), return_when=asyncio.FIRST_COMPLETED)
        if writing.done():
            writing.result()  # raises the write's own failure, if any
            return
        raise asyncio.InvalidStateError("the call ended while a write waited to start")
    finally:
        for fut in (writing, ended):
            fut.cancel()  # no-op when done
        if writing.done() and not writing.cancelled():
            writing.exception()  # retrieved: the InvalidStateError above already says what happened


def unmask_transport_failure(err: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
    """The UNAVAILABLE hidden behind grpc.aio's local INTERNAL status.

    When a connection breaks while a message is being sent, grpc.aio ends the call with a status it makes
    up itself (INTERNAL, "Internal error from Core", a failed ``execute_batch``) instead of the transport's
    UNAVAILABLE, depending only on whether the send or the status was noticed first. It is the same
    failure (the peer went away), so it is retried and answered as one."""
    if err.code() == grpc.StatusCode.INTERNAL and "execute_batch" in (err.debug_error_string() or ""):
        details = f"connection lost while sending ({err.details()})"
        return grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details
        )
    return err


class ReplicaPicker(Protocol):
    """What a stream needs from its stage client (:class:`gateway.stage_clients.StageClient`)."""

    stage: str
    on_unavailable: Callable[[Replica], None] | None

    def pick(self, avoid: Replica | None = None) -> Replica: ...


class StageStream:
    """A bidi ``Generate`` call with replay-on-UNAVAILABLE until the first response arrives."""

    def __init__(self, client: ReplicaPicker, deadline_s: float, retries: int = 1) -> None:
        self.client = client
        self.stage = client.stage
        self._deadline = time.monotonic() + deadline_s
        self._retries_left = retries
        self._sent: list[Any] | None = []  # replay buffer; None once the first response arrived
        self._half_closed = False
        self._closed = False
        self._failed: StageFailure | None = None
        self._reopen_lock = asyncio.Lock()  # one reopen at a time; see _retrying
        self._generation = 0  # bumped by each reopen (the replay covers what was queued before it)
        self.replica = client.pick()
        self._call = self._new_call()

    def _new_call(self) -> Any:
        remaining = max(0.001, self._deadline - time.monotonic())
        return self.replica.stub.Generate(timeout=remaining)

    def _can_retry(self, err: grpc.aio.AioRpcError) -> bool:
        return (
            self._sent is not None
            and self._retries_left > 0
            and err.code() == grpc.StatusCode.UNAVAILABLE
            and self._failed is None
            and not self._closed
        )

    async def _reopen(self, replica: Replica) -> None:
        """Open a fresh call on ``replica`` and replay everything written so far."""
        self._retries_left -= 1
        self._call.cancel()
        self.replica = replica
        self._call = self._new_call()
        # What this replay covers is fixed here, with the call swap (no await in between): a write that
        # queued after it waits for the replay and then sends itself (see _after_reopen).
        self._generation += 1
        replay, half_closed = list(self._sent or ()), self._half_closed
        for msg in replay:
            await write_or_end(self._call, msg)
        if half_closed:
            await self._call.done_writing()

    async def _after_reopen(self, generation: int) -> bool:
        """Wait out a reopen in progress; True when its replay already covered what the caller queued at
        ``generation`` (so sending it again would duplicate it), False when the caller must send it."""
        if not self._reopen_lock.locked():
            return False
        async with self._reopen_lock:
            return self._generation != generation

    async def _retrying(self, op: Any) -> Any:
        """Run ``op(call)``; on a retryable failure reopen + replay, then report whether a retry happened.

        The reader and the writer of one stream run in different tasks and usually meet the same failure
        together. Only the first of them reopens (under ``_reopen_lock``); the other finds the call already
        replaced and simply goes on with the new one, so the single retry is not spent twice and the
        reopen's cancel of the old call never reaches the other task as a stray CancelledError."""
        if self._failed is not None:
            raise self._failed
        call = self._call
        try:
            return await op(call), False
        except grpc.aio.AioRpcError as err:
            failure = unmask_transport_failure(err)
        except asyncio.InvalidStateError:
            if self._failed is not None:
                raise self._failed from None
            # Writing to a call that already ended: its final status says why (e.g. UNAVAILABLE).
            failure = await self._terminal_error(call)
        except asyncio.CancelledError:
            if self._failed_under_us():
                raise self._failed from None  # type: ignore[misc]
            if self._replaced_under_us(call):
                return None, True
            raise
        async with self._reopen_lock:
            if call is not self._call:
                return None, True  # another task met this failure first and already reopened + replayed
            if not self._can_retry(failure):
                raise self._failure(failure) from failure
            replica = self.client.pick(avoid=self.replica)
            if replica.down:  # no replica the health monitor has not already found down: fail now
                raise self._failure(failure) from failure
            self._report(failure)
            log.warning(
                "%s stream unavailable before first output (%s); retrying once", self.stage, failure.details()
            )
            STAGE_RETRIES.labels(self.stage).inc()
            await self._reopen_or_fail(replica)
        return None, True

    async def _reopen_or_fail(self, replica: Replica) -> None:
        """:meth:`_reopen`, with any failure of the new call turned into the stream's final failure."""
        try:
            await self._reopen(replica)
        except grpc.aio.AioRpcError as err:
            raise self._failure(unmask_transport_failure(err)) from err
        except asyncio.InvalidStateError:
            if self._failed is not None:
                raise self._failed from None
            ended = await self._terminal_error(self._call)
            raise self._failure(ended) from ended
        except asyncio.CancelledError:
            if self._failed_under_us():
                raise self._failed from None  # type: ignore[misc]
            raise

    def _replaced_under_us(self, call: Any) -> bool:
        """True when a CancelledError came from a reopen in another task cancelling ``call`` (which it
        replaced), not from our own task being cancelled."""
        task = asyncio.current_task()
        return call is not self._call and not (task is not None and task.cancelling())

    def _failed_under_us(self) -> bool:
        """True when a CancelledError came from :meth:`fail` cancelling the call, not from our own task
        being cancelled (which must propagate)."""
        task = asyncio.current_task()
        return self._failed is not None and not (task is not None and task.cancelling())

    @staticmethod
    async def _terminal_error(call: Any) -> grpc.aio.AioRpcError:
        code = await call.code()
        details = await call.details()
        debug = await call.debug_error_string()
        meta = grpc.aio.Metadata()
        err = grpc.aio.AioRpcError(code, meta, meta, details=details, debug_error_string=debug)
        return unmask_transport_failure(err)

    def _failure(self, err: grpc.aio.AioRpcError) -> StageFailure:
        self._report(err)
        return StageFailure.from_rpc_error(self.stage, self.replica.label, err)

    def _report(self, err: grpc.aio.AioRpcError) -> None:
        """Tell the health monitor that this replica just failed a call as UNAVAILABLE."""
        hook = self.client.on_unavailable
        if hook is not None and err.code() == grpc.StatusCode.UNAVAILABLE:
            hook(self.replica)

    async def write(self, msg: Message) -> None:
        """Send one request; awaits gRPC flow control, which is the backpressure towards the stage."""
        generation = self._generation
        if self._sent is not None:
            self._sent.append(msg)
        if await self._after_reopen(generation):
            return
        if self._sent is None:
            # A response already came, so the call's metadata went out long ago: a plain write cannot hit
            # the wait that write_or_end guards against, and the hot path skips its two extra tasks.
            await self._retrying(lambda call: call.write(msg))
        else:
            await self._retrying(lambda call: write_or_end(call, msg))

    async def done_writing(self) -> None:
        generation = self._generation
        self._half_closed = True
        if await self._after_reopen(generation):
            return
        await self._retrying(lambda call: call.done_writing())

    async def read(self) -> Any | None:
        """Next response, or None at the end of the stream."""
        while True:
            msg, retried = await self._retrying(lambda call: call.read())
            if retried:
                continue
            if msg is grpc.aio.EOF:
                return None
            self._sent = None  # output arrived: from now on a failure is final
            return msg

    async def responses(self) -> AsyncIterator[Any]:
        """The stage's responses until the end of the stream (their message type is the stage's)."""
        while (msg := await self.read()) is not None:
            yield msg

    async def finish(self, timeout_s: float = 2.0) -> None:
        """Normal end: half-close and read to the end so the stage's handler returns on its own, then
        cancel whatever did not end within ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                if not self._half_closed:
                    self._half_closed = True
                    await self._call.done_writing()
                while await self._call.read() is not grpc.aio.EOF:
                    pass
        except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass
        except asyncio.CancelledError:
            if not self._failed_under_us():
                raise
        finally:
            self.cancel()

    def fail(self, reason: str) -> bool:
        """End this stream with a 503 failure for whoever reads or writes it next (or waits on it now)."""
        if self._closed or self._call.done():
            return False
        self._failed = StageFailure(self.stage, 503, reason, "stage_unavailable", "ServiceUnavailableError")
        self.cancel()
        return True

    def cancel(self) -> None:
        """Abort the call; the stage sees CANCELLED and frees the stream's state."""
        if not self._closed:
            self._closed = True
            if not self._call.done():
                self._call.cancel()
