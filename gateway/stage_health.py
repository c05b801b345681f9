"""A live view of which stages serve, kept by probing each one in the background.

Why a monitor rather than asking on demand: a streaming chat answers 200 as soon as the thinker's first
token arrives, so a request that needs code2wav would only learn that code2wav is down after the stream
started (an SSE error instead of a 503). With the monitor, routes check the stages a request needs
*before* any work (:meth:`StageMonitor.require`) and answer 503 with ``Retry-After``; ``/health`` answers
from the same view at once instead of waiting on three probes.

Each stage gets ``grpc.health.v1.Health/Check`` every ``interval_s`` with a ``timeout_s`` deadline. A
refused connection or NOT_SERVING marks the stage down at once; a probe that times out (a stopped or
wedged process) only after ``timeouts_to_fail`` in a row, so one slow answer under CPU load does not
flap it. When a stage goes down, the streams the gateway has open to it are failed (see
:meth:`gateway.stage_clients.StageClient.fail_open_streams`): a stage that stopped answering (SIGSTOP)
cannot keep a client waiting for the whole request deadline. A stage behind a replica list counts as
serving while the probe reaches any replica (the channel balances probes like requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc

from gateway.metrics import STAGE_UP
from gateway.stage_clients import StageFailure, StageSet

log = logging.getLogger(__name__)

RETRY_AFTER_S = 3  # what a 503 for a stage that is down tells clients (the launcher restarts it meanwhile)


@dataclass
class StageState:
    serving: bool | None = None  # None: not probed yet
    reason: str = "not probed yet"
    since: float = field(default_factory=time.monotonic)
    timeouts: int = 0  # consecutive probe deadlines exceeded


class StageMonitor:
    """Background probes of every stage of a :class:`StageSet`; start inside the server's event loop."""

    def __init__(
        self, stages: StageSet, interval_s: float = 0.5, timeout_s: float = 1.0, timeouts_to_fail: int = 2
    ) -> None:
        self.stages = stages
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.timeouts_to_fail = timeouts_to_fail
        self.states = {client.stage: StageState() for client in stages}
        self._probed = {client.stage: asyncio.Event() for client in stages}
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(c.stage), name=f"probe-{c.stage}") for c in self.stages]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def _run(self, stage: str) -> None:
        client = self.stages[stage]
        while True:
            started = time.monotonic()
            ok, reason = await client.check_health(timeout_s=self.timeout_s)
            self._record(stage, ok, reason)
            self._probed[stage].set()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    def _record(self, stage: str, ok: bool, reason: str) -> None:
        state = self.states[stage]
        if ok:
            state.timeouts = 0
        elif reason.startswith(grpc.StatusCode.DEADLINE_EXCEEDED.name):
            state.timeouts += 1
            if state.timeouts < self.timeouts_to_fail and state.serving is not False:
                return  # one slow answer: keep the previous view
            reason = f"not answering health checks within {self.timeout_s:g} s"
        if ok != state.serving:
            if state.serving is not None or not ok:
                log.warning("stage %s is %s (%s)", stage, "serving again" if ok else "DOWN", reason)
            state.serving, state.since = ok, time.monotonic()
            STAGE_UP.labels(stage).set(1 if ok else 0)
            if not ok:
                self.stages[stage].fail_open_streams(f"{stage} stage went down: {reason}")
        state.reason = "serving" if ok else reason

    async def snapshot(self, wait_s: float = 1.5) -> dict[str, tuple[bool, str]]:
        """(serving?, reason) per stage; waits up to ``wait_s`` for stages that were never probed."""
        pending = [ev.wait() for ev in self._probed.values() if not ev.is_set()]
        if pending:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await asyncio.gather(*pending)
        return {s: (st.serving is True, st.reason) for s, st in self.states.items()}

    def is_down(self, stage: str) -> bool:
        """Known down: the last probe(s) failed, or the channel has no connectable replica right now."""
        if self.states[stage].serving is False:
            return True
        channel = self.stages[stage].channel
        return channel.get_state(try_to_connect=False) == grpc.ChannelConnectivity.TRANSIENT_FAILURE

    def require(self, stages: Iterable[str]) -> None:
        """Raise a 503 :class:`StageFailure` (with a retry hint) for the first needed stage known down.

        A stage not probed yet counts as up: the request then finds out the usual way (stream retry).
        """
        for stage in stages:
            if self.is_down(stage):
                client = self.stages[stage]
                reason = self.states[stage].reason
                if self.states[stage].serving is not False:
                    reason = "no replica is reachable"
                raise StageFailure(
                    stage,
                    503,
                    f"{stage} stage is unavailable at {client.target}: {reason}; retry shortly",
                    "stage_unavailable",
                    "ServiceUnavailableError",
                    retry_after_s=RETRY_AFTER_S,
                )
