"""A live view of which stages - and which replicas of each - serve, kept by probing every replica.

Why a monitor rather than asking on demand: a streaming chat answers 200 as soon as the thinker's first
token arrives, so a request that needs code2wav would only learn that code2wav is down after the stream
started (an SSE error instead of a 503). With the monitor, routes check the stages a request needs
*before* any work (:meth:`StageMonitor.require`) and answer 503 with ``Retry-After``; ``/health`` answers
from the same view (:meth:`StageMonitor.report`) instead of waiting on fresh probes.

Every replica of a stage (:class:`gateway.replica.Replica`: one per address of a fixed list, one
for a DNS name) gets ``grpc.health.v1.Health/Check`` every ``interval_s`` with a ``timeout_s``
deadline, over a probe channel of its own. A refused connection or NOT_SERVING marks the replica down at
once; a probe that times out (a stopped or wedged process) only after ``timeouts_to_fail`` in a row, so
one slow answer under CPU load does not flap it. When a replica goes down, the streams the gateway has
open to *that replica* are failed (:meth:`gateway.stage_clients.StageClient.fail_open_streams`), so a
replica that stopped answering (SIGSTOP) cannot keep a client waiting for the whole request deadline,
and new streams are routed to the replicas still up. A stage serves while any replica does.

A stream that fails as UNAVAILABLE wakes its replica's probe at once (``StageClient.on_unavailable``),
and :meth:`StageMonitor.report` waits (bounded) for such a re-probe: otherwise a client that just got
"code2wav unavailable" could read ``/health`` saying code2wav is ok, from the probe before the failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc

from gateway.metrics import REPLICA_UP, STAGE_UP
from gateway.replica import Replica
from gateway.stage_clients import StageClient, StageSet
from gateway.stage_failure import StageFailure

log = logging.getLogger(__name__)

RETRY_AFTER_S = 3  # what a 503 for a stage that is down tells clients (the launcher restarts it meanwhile)


@dataclass
class ReplicaState:
    serving: bool | None = None  # None: not probed yet
    reason: str = "not probed yet"
    since: float = field(default_factory=time.monotonic)
    timeouts: int = 0  # consecutive probe deadlines exceeded
    probes: int = 0  # probes recorded so far (a waiter for a fresh probe compares this)
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # probe now, not at the next interval
    recorded: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) per probe
    stale: bool = False  # a stream failed on this replica after its last probe: the view is old


@dataclass
class StageReport:
    """What ``/health`` says about one stage."""

    serving: bool  # at least one replica serves
    summary: str  # "ok", "degraded (...)" or why no replica serves
    replicas: dict[str, str]  # label -> "ok" or why not


class StageMonitor:
    """Background probes of every replica of a :class:`StageSet`; start inside the server's event loop."""

    def __init__(
        self, stages: StageSet, interval_s: float = 0.5, timeout_s: float = 1.0, timeouts_to_fail: int = 2
    ) -> None:
        self.stages = stages
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.timeouts_to_fail = timeouts_to_fail
        self.states: dict[str, dict[str, ReplicaState]] = {
            client.stage: {r.label: ReplicaState() for r in client.replicas} for client in stages
        }
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for client in self.stages:
            client.on_unavailable = self._stream_failed
            for replica in client.replicas:
                name = f"probe-{client.stage}-{replica.label}"
                self._tasks.append(asyncio.create_task(self._run(client, replica), name=name))

    async def stop(self) -> None:
        for client in self.stages:
            client.on_unavailable = None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    def _state(self, client: StageClient, replica: Replica) -> ReplicaState:
        return self.states[client.stage][replica.label]

    def _stream_failed(self, replica: Replica) -> None:
        for client in self.stages:
            if replica in client.replicas:
                state = self._state(client, replica)
                state.stale = True
                state.wake.set()

    async def _run(self, client: StageClient, replica: Replica) -> None:
        state = self._state(client, replica)
        while True:
            state.wake.clear()
            stale = state.stale
            ok, reason = await client.check_health(replica, timeout_s=self.timeout_s)
            self._record(client, replica, ok, reason)
            if stale and state.stale:
                state.stale = False  # this probe started after the failure that made the view stale
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await state.wake.wait()

    def _record(self, client: StageClient, replica: Replica, ok: bool, reason: str) -> None:
        state, stage = self._state(client, replica), client.stage
        state.probes += 1
        done, state.recorded = state.recorded, asyncio.Event()
        done.set()
        if ok:
            state.timeouts = 0
        elif reason.startswith(grpc.StatusCode.DEADLINE_EXCEEDED.name):
            state.timeouts += 1
            if state.timeouts < self.timeouts_to_fail and state.serving is not False:
                return  # one slow answer: keep the previous view
            reason = f"not answering health checks within {self.timeout_s:g} s"
        if ok != state.serving:
            if state.serving is not None or not ok:
                what = "serving again" if ok else "DOWN"
                log.warning("stage %s replica %s is %s (%s)", stage, replica.label, what, reason)
            state.serving, state.since = ok, time.monotonic()
            replica.down = not ok
            REPLICA_UP.labels(stage, replica.label).set(1 if ok else 0)
            STAGE_UP.labels(stage).set(1 if self._any_serving(stage) else 0)
            if not ok:
                client.fail_open_streams(f"{stage} stage went down at {replica.label}: {reason}", replica)
        state.reason = "serving" if ok else reason

    def _any_serving(self, stage: str) -> bool:
        return any(st.serving for st in self.states[stage].values())

    async def _fresh(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` until every replica has been probed once and none is stale."""
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            waits = [
                asyncio.ensure_future(st.recorded.wait())
                for replicas in self.states.values()
                for st in replicas.values()
                if st.serving is None or st.stale
            ]
            if not waits:
                return
            try:
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    async def report(self, wait_s: float = 1.5) -> dict[str, StageReport]:
        """Per stage: serving?, a summary naming the replicas that are down, and each replica's status.

        Waits up to ``wait_s`` for replicas never probed yet or whose view a failed stream made stale."""
        await self._fresh(wait_s)
        out: dict[str, StageReport] = {}
        for client in self.stages:
            replicas = {}
            for replica in client.replicas:
                st = self._state(client, replica)
                if st.serving is not True:
                    replicas[replica.label] = st.reason
                elif replica.unreachable():
                    replicas[replica.label] = "no connection (the last attempt failed)"
                else:
                    replicas[replica.label] = "ok"
            bad = {label: why for label, why in replicas.items() if why != "ok"}
            serving = len(bad) < len(replicas)
            if not bad:
                summary = "ok"
            elif not serving and len(replicas) == 1:
                summary = next(iter(bad.values()))
            else:
                named = "; ".join(f"{label}: {why}" for label, why in bad.items())
                head = "degraded" if serving else "down"
                summary = f"{head} ({len(bad)} of {len(replicas)} replicas down): {named}"
            out[client.stage] = StageReport(serving, summary, replicas)
        return out

    def is_down(self, stage: str) -> bool:
        """Known down: no replica serves by the last probes, or none has a connectable channel now."""
        return all(
            replica.unreachable() or self._state(self.stages[stage], replica).serving is False
            for replica in self.stages[stage].replicas
        )

    def require(self, stages: Iterable[str]) -> None:
        """Raise a 503 :class:`StageFailure` (with a retry hint) for the first needed stage known down.

        A stage not probed yet counts as up: the request then finds out the usual way (stream retry).
        """
        for stage in stages:
            if self.is_down(stage):
                client = self.stages[stage]
                reasons = {self._state(client, r).reason for r in client.replicas if r.down}
                reason = "; ".join(sorted(reasons)) if reasons else "no replica is reachable"
                raise StageFailure(
                    stage,
                    503,
                    f"{stage} stage is unavailable at {client.target}: {reason}; retry shortly",
                    "stage_unavailable",
                    "ServiceUnavailableError",
                    retry_after_s=RETRY_AFTER_S,
                )
