"""Connections from the gateway to the three stage services, reusable by every route.

One :class:`StageClient` per stage owns one gRPC channel. The channel target comes from config:

* ``host:port`` or ``dns:///host:port`` - DNS name, every A/AAAA record is a replica (Kubernetes
  headless Service, compose scale);
* ``ipv4:10.0.0.1:50051,10.0.0.2:50051`` or a comma list ``h1:p1,h2:p2`` of IP literals - fixed replicas
  (the embedded launcher uses this for profiles with several replicas per stage).

A fixed list is split into one :class:`Replica` per address, each with its own request channel and its
own probe channel, so the health monitor (:mod:`gateway.stage_health`) judges every replica on its own: a
replica that stopped answering (SIGSTOP, wedged) is marked down even while its peers answer, new streams
go round-robin over the replicas not marked down, and ``/health`` names the bad one. A DNS name stays one
replica entry whose channel balances round-robin over every record the resolver returns (the records of a
headless Service change while it runs, so they are not split here); client-side health checking keeps a
record that reports NOT_SERVING (draining) out of that channel's rotation.

:meth:`StageClient.open_stream` returns a :class:`gateway.stage_stream_client.StageStream`, a bidi ``Generate``
call with a deadline and one replay-on-UNAVAILABLE retry before its first output. Every failure surfaces
as a :class:`gateway.stage_failure.StageFailure`, so routes never see raw ``grpc`` exceptions.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.replica import Replica
from gateway.stage_failure import StageFailure
from gateway.stage_stream_client import StageStream
from services.common.grpc_server import GRPC_OPTIONS
from services.common.pb import (
    code2wav_pb2_grpc,
    common_pb2,
    talker_pb2_grpc,
    thinker_pb2_grpc,
)
from services.common.tls import ClientTLS

log = logging.getLogger(__name__)

STAGE_SERVICES: dict[str, str] = {
    "thinker": "minicpmo.v1.ThinkerService",
    "talker": "minicpmo.v1.TalkerService",
    "code2wav": "minicpmo.v1.Code2WavService",
}
_STUBS: dict[str, Any] = {
    "thinker": thinker_pb2_grpc.ThinkerServiceStub,
    "talker": talker_pb2_grpc.TalkerServiceStub,
    "code2wav": code2wav_pb2_grpc.Code2WavServiceStub,
}


def normalize_target(addr: str) -> str:
    """Turn a config address into a gRPC target with a resolver that knows every replica."""
    addr = addr.strip()
    if "://" in addr or addr.startswith(("ipv4:", "ipv6:", "unix:")):
        return addr
    parts = [p.strip() for p in addr.split(",") if p.strip()]
    if len(parts) > 1:
        hosts = [p.rsplit(":", 1)[0].strip("[]") for p in parts]
        try:
            versions = {ipaddress.ip_address(h).version for h in hosts}
        except ValueError as exc:
            raise ValueError(
                f"address list {addr!r}: several replicas must be IP literals (use one DNS name for hostnames)"
            ) from exc
        if versions == {4}:
            return "ipv4:" + ",".join(parts)
        if versions == {6}:
            return "ipv6:" + ",".join(parts)
        raise ValueError(f"address list {addr!r} mixes IPv4 and IPv6")
    return f"dns:///{addr}"


def replica_targets(addr: str) -> list[tuple[str, str]]:
    """``(label, gRPC target)`` per replica the gateway can tell apart: one per address of a fixed list, a
    single entry for a DNS name (or ``unix:``), whose records gRPC's resolver balances itself."""
    target = normalize_target(addr)
    for scheme in ("ipv4:", "ipv6:"):
        if target.startswith(scheme):
            parts = [p for p in target.removeprefix(scheme).split(",") if p]
            return [(part, scheme + part) for part in parts]
    return [(addr.strip(), target)]


def _service_config(stage: str) -> str:
    return json.dumps(
        {
            "loadBalancingConfig": [{"round_robin": {}}],
            "healthCheckConfig": {"serviceName": STAGE_SERVICES[stage]},
        }
    )


# How fast a channel reconnects to a stage that went away: gRPC's default backoff grows to 120 s (and
# starts at 1 s with jitter), so a stage restarted by the launcher looked "serving" while the gateway
# kept failing to reach it for ~10 s. Capped at 1 s: a reconnect attempt to a loopback or in-cluster
# address is cheap.
RECONNECT_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass
class StageTimeouts:
    """Deadlines: whole stream, health probes, and how long to wait for a channel to connect on retry."""

    stream_s: float = 600.0
    health_s: float = 2.0
    info_s: float = 5.0


class StageClient:
    """The replicas of one stage, picked round-robin among those not known down."""

    def __init__(
        self, stage: str, addr: str, timeouts: StageTimeouts | None = None, tls: ClientTLS | None = None
    ) -> None:
        if stage not in STAGE_SERVICES:
            raise ValueError(f"unknown stage {stage!r}")
        self.stage = stage
        self.addr = addr
        self.target = normalize_target(addr)
        self.timeouts = timeouts or StageTimeouts()
        self.tls = tls
        options = [
            *GRPC_OPTIONS,
            *RECONNECT_OPTIONS,
            ("grpc.service_config", _service_config(stage)),
            ("grpc.enable_retries", 0),
        ]
        self.replicas: list[Replica] = []
        for label, target in replica_targets(addr):
            channel, probe_channel = self._open_channel(target, options), self._open_channel(target, options)
            self.replicas.append(
                Replica(
                    label,
                    target,
                    channel,
                    _STUBS[stage](channel),
                    health_pb2_grpc.HealthStub(probe_channel),
                    probe_channel,
                )
            )
        self._next = 0  # round-robin position over self.replicas
        self.info: common_pb2.StageInfo | None = None
        self._open_streams: weakref.WeakSet[StageStream] = weakref.WeakSet()
        # Called with the replica when a stream to it fails as UNAVAILABLE (the health monitor re-probes
        # it at once instead of at its next interval, so /health agrees with what the client just saw).
        self.on_unavailable: Callable[[Replica], None] | None = None

    def pick(self, avoid: Replica | None = None) -> Replica:
        """The next replica round-robin, skipping ``avoid`` and replicas known down while another is left."""
        n = len(self.replicas)
        order = [self.replicas[(self._next + i) % n] for i in range(n)]
        rules: tuple[Callable[[Replica], bool], ...] = (
            lambda r: r is not avoid and not r.unreachable(),
            lambda r: r is not avoid,
            lambda r: True,
        )
        for usable in rules:
            chosen = next((r for r in order if usable(r)), None)
            if chosen is not None:
                self._next = (self.replicas.index(chosen) + 1) % n
                return chosen
        raise AssertionError("a stage has at least one replica")

    async def check_health(
        self, replica: Replica | None = None, timeout_s: float | None = None
    ) -> tuple[bool, str]:
        """(serving?, human-readable reason) of one replica (default: the first). Never raises."""
        replica = replica or self.replicas[0]
        try:
            resp = await replica.health.Check(
                health_pb2.HealthCheckRequest(service=STAGE_SERVICES[self.stage]),
                timeout=timeout_s or self.timeouts.health_s,
            )
        except grpc.aio.AioRpcError as err:
            return False, f"{err.code().name}: {err.details()}"
        except Exception as err:  # noqa: BLE001 - a probe must answer, whatever broke
            return False, repr(err)
        if resp.status == health_pb2.HealthCheckResponse.SERVING:
            return True, "serving"
        return False, health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def get_info(self) -> common_pb2.StageInfo:
        try:
            self.info = await self.pick().stub.GetInfo(
                common_pb2.GetInfoRequest(), timeout=self.timeouts.info_s
            )
        except grpc.aio.AioRpcError as err:
            raise StageFailure.from_rpc_error(self.stage, self.target, err) from err
        return self.info

    def open_stream(self, deadline_s: float | None = None, retry: bool = True) -> StageStream:
        stream = StageStream(self, deadline_s or self.timeouts.stream_s, retries=1 if retry else 0)
        self._open_streams.add(stream)
        return stream

    def fail_open_streams(self, reason: str, replica: Replica | None = None) -> int:
        """End every open stream to this stage (or to one ``replica``) with a 503 ``StageFailure`` (the
        health monitor found it down); returns how many. Whoever waits on such a stream gets the failure at
        once instead of at its deadline - a stopped process keeps its TCP connection, so gRPC alone would
        not notice."""
        failed = 0
        for stream in list(self._open_streams):
            if (replica is None or stream.replica is replica) and stream.fail(reason):
                failed += 1
        return failed

    def _open_channel(self, target: str, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        if self.tls is None:
            return grpc.aio.insecure_channel(target, options=options)
        # the stage's certificate is verified against tls.ca_file; mTLS also presents ours
        return grpc.aio.secure_channel(target, self.tls.credentials(), options=options)

    async def close(self) -> None:
        await asyncio.gather(
            *(ch.close(grace=None) for r in self.replicas for ch in (r.channel, r.probe_channel))
        )


class StageSet:
    """The three stage clients the gateway talks to (plus helpers routes and the realtime code share)."""

    def __init__(
        self, addrs: dict[str, str], timeouts: StageTimeouts | None = None, tls: ClientTLS | None = None
    ) -> None:
        missing = [s for s in STAGE_SERVICES if s not in addrs]
        if missing:
            raise ValueError(f"stage addresses missing for {missing}")
        self.clients = {s: StageClient(s, addrs[s], timeouts, tls) for s in STAGE_SERVICES}

    def __getitem__(self, stage: str) -> StageClient:
        return self.clients[stage]

    def __iter__(self) -> Iterator[StageClient]:
        return iter(self.clients.values())

    async def health(self) -> dict[str, tuple[bool, str]]:
        """(serving?, reason) per stage, asked now: serving when any of its replicas serves."""

        async def stage(client: StageClient) -> tuple[bool, str]:
            results = await asyncio.gather(*(client.check_health(r) for r in client.replicas))
            return next((res for res in results if res[0]), results[0])

        names = list(self.clients)
        results = await asyncio.gather(*(stage(self.clients[s]) for s in names))
        return dict(zip(names, results, strict=True))

    async def fetch_info(self) -> dict[str, common_pb2.StageInfo | None]:
        """GetInfo from every stage; a stage that is down gives None (logged), so start-up never blocks."""
        out: dict[str, common_pb2.StageInfo | None] = {}
        for name, client in self.clients.items():
            try:
                out[name] = await client.get_info()
            except StageFailure as exc:
                log.warning("GetInfo %s failed: %s", name, exc)
                out[name] = None
        return out

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients.values()))
