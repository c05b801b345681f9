"""The gRPC front every stage shares: asyncio server, health, reflection, metrics, graceful drain.

A stage's ``server.py`` builds its servicer (a thin adapter over its engine, whose ``Generate`` is
:class:`~services.common.stage_stream.StageStreamDriver`) and wraps it in a :class:`StageServer`; the
stage CLI runs that with :func:`serve_forever`. This module owns everything about the process that is
the same for all three stages: options and flags, health, reflection, the metrics port and the drain.

Shutdown order on SIGTERM/SIGINT (Kubernetes sends SIGTERM after preStop):
1. health flips to NOT_SERVING, so load balancers and the gateway stop sending new streams;
2. ``drain()`` of the stage runs (engines finish or cancel in-flight work) for up to ``drain_timeout_s``;
3. the gRPC server stops with a short grace period, cancelling whatever is left.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import slow_steps
from services.common.deploy_profile import DEFAULT_STAGE_PORTS
from services.common.deploy_schema import port_or_zero_arg
from services.common.gpu_sharing import PRIORITIES
from services.common.heap import prepare_heap_for_serving
from services.common.metrics import DRAINING
from services.common.tls import ServerTLS, server_tls_args

log = logging.getLogger(__name__)

# Hidden-state chunks and audio windows are small, but a duplex open can carry a reference voice and
# video frames; 64 MiB keeps large prompts working without unbounded memory.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]
# The gateway's channels ping every 20 s (GRPC_OPTIONS) so a dead stage is noticed mid-stream; the
# server must accept pings that often, or after two "strikes" it sends GOAWAY(too_many_pings) and every
# stream on that connection dies.
# gRPC sets SO_REUSEPORT on its listening sockets by default: a second stage started on a taken port then
# binds beside the holder, reports SERVING, and never sees a connection (the kernel hands them to the
# holder). Off, a taken port fails the bind and the stage exits naming it.
SERVER_OPTIONS: list[tuple[str, int]] = [
    *GRPC_OPTIONS,
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),
]


class PortInUseError(RuntimeError):
    """A stage's gRPC or metrics port could not be bound; the message names it."""


@dataclass
class ServeOptions:
    """Network and lifecycle settings common to every stage CLI."""

    host: str = "127.0.0.1"  # loopback unless --host says otherwise (containers pass 0.0.0.0)
    port: int = 0
    metrics_port: int | None = None  # None: port + 1000; 0: disabled
    drain_timeout_s: float = 30.0
    tls: ServerTLS | None = None  # None: plaintext gRPC (services/common/tls.py)

    def resolved_metrics_port(self) -> int:
        if self.metrics_port is None:
            return self.port + 1000 if self.port else 0
        return self.metrics_port


def add_serve_arguments(parser: argparse.ArgumentParser, stage: str) -> None:
    """The flags every stage CLI accepts (besides its model/engine flags)."""
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind, metrics included (default loopback; 0.0.0.0 for all interfaces)",
    )
    parser.add_argument(
        "--port",
        type=port_or_zero_arg,
        default=DEFAULT_STAGE_PORTS[stage],
        help="gRPC port (0: any free one)",
    )
    parser.add_argument(
        "--metrics-port",
        type=port_or_zero_arg,
        default=None,
        help="Prometheus HTTP port (default: gRPC port + 1000; 0 disables)",
    )
    parser.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds to let in-flight streams finish on SIGTERM"
    )
    parser.add_argument(
        "--slow-step-ms",
        type=float,
        default=slow_steps.DEFAULT_MS,
        metavar="MS",
        help="log an engine step slower than this with its phases (0: off; profile slow_step_ms)",
    )
    parser.add_argument(
        "--gpu-priority",
        choices=PRIORITIES,
        default="normal",
        help="under MPS, this stage's GPU work against the other stages' (profile gpu_priority)",
    )
    parser.add_argument(
        "--tls-cert", default=None, help="serve gRPC over TLS with this certificate chain (PEM)"
    )
    parser.add_argument("--tls-key", default=None, help="private key of --tls-cert (PEM)")
    parser.add_argument(
        "--tls-client-ca",
        default=None,
        help="mutual TLS: require client certificates signed by this CA (PEM)",
    )


def serve_options_from_args(args: argparse.Namespace) -> ServeOptions:
    try:
        tls = server_tls_args(args.tls_cert, args.tls_key, args.tls_client_ca)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    return ServeOptions(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        drain_timeout_s=args.drain_timeout,
        tls=tls,
    )


class StageServer:
    """A started gRPC server for one stage; used by the CLI and by tests (port 0 picks a free port)."""

    def __init__(
        self,
        stage: str,
        service_full_name: str,
        add_servicer: Callable[[grpc.aio.Server], None],
        options: ServeOptions,
        drain: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.stage = stage
        self.service_full_name = service_full_name
        self._add_servicer = add_servicer
        self.options = options
        self._drain = drain
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.port = 0
        self.metrics_port = 0
        self._stopped = asyncio.Event()

    async def start(self) -> int:
        server = grpc.aio.server(options=SERVER_OPTIONS)
        self._add_servicer(server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (self.service_full_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        address = f"{self.options.host}:{self.options.port}"
        tls = self.options.tls
        taken = f"{self.stage}: cannot bind gRPC port {self.options.port} on {self.options.host} (in use?)"
        try:
            self.port = (
                server.add_secure_port(address, tls.credentials())
                if tls
                else server.add_insecure_port(address)
            )
        except RuntimeError as exc:  # grpcio raises "Failed to bind" where older versions returned 0
            raise PortInUseError(taken) from exc
        if self.port == 0:
            raise PortInUseError(taken)
        await server.start()
        self.server = server
        mport = self.options.resolved_metrics_port()
        if mport:
            from prometheus_client import start_http_server

            try:
                start_http_server(mport, addr=self.options.host)
            except OSError as exc:
                await server.stop(None)
                raise PortInUseError(
                    f"{self.stage}: cannot bind metrics port {mport} on {self.options.host}: {exc.strerror}"
                ) from exc
            self.metrics_port = mport
        await self.set_serving(True)
        mode = "plaintext" if tls is None else ("mutual TLS" if tls.client_ca_file else "TLS")
        log.info(
            "%s serving gRPC (%s) on %s:%d (metrics %s)",
            self.stage,
            mode,
            self.options.host,
            self.port,
            mport or "off",
        )
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set("", status)
        await self.health.set(self.service_full_name, status)

    async def stop(self, grace: float = 1.0) -> None:
        """Graceful drain then stop; safe to call twice."""
        if self.server is None or self._stopped.is_set():
            return
        DRAINING.labels(self.stage).set(1)
        await self.set_serving(False)
        if self._drain is not None:
            try:
                await asyncio.wait_for(self._drain(), timeout=self.options.drain_timeout_s)
            except TimeoutError:
                log.warning(
                    "%s: drain exceeded %.1fs; cancelling the rest", self.stage, self.options.drain_timeout_s
                )
        await self.server.stop(grace)
        self._stopped.set()
        DRAINING.labels(self.stage).set(0)

    async def wait(self) -> None:
        assert self.server is not None
        await self.server.wait_for_termination()


async def serve_forever(server: StageServer) -> None:
    """Start ``server`` and block until SIGTERM/SIGINT, then drain and stop.

    The stage's model, warm-up and graphs exist by now: their objects leave the GC's full passes first
    (:mod:`services.common.heap`)."""
    prepare_heap_for_serving()
    try:
        await server.start()
    except PortInUseError as exc:
        print(f"[{server.stage}] {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    print(f"[{server.stage}] listening on {server.options.host}:{server.port}", flush=True)
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    await stop_requested.wait()
    print(f"[{server.stage}] draining", flush=True)
    await server.stop()
