"""Container health check for a stage: ask its ``grpc.health.v1.Health`` service for the overall status.

Used by the Dockerfile's HEALTHCHECK and compose's ``healthcheck`` (Kubernetes uses its native gRPC probe
instead). Exit status 0 means SERVING; anything else (NOT_SERVING while loading or draining, connection
refused, timeout) is 1, which is all a container runtime looks at. Kept to grpcio + grpcio-health-checking
so it starts in well under a second.

    python /opt/minicpmo/docker/grpc_health_probe.py [--port P] [--host H] [--service NAME] [--timeout S]
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_PORTS = {"thinker": 50051, "talker": 50052, "code2wav": 50053}


def default_port() -> int:
    """The port the container's stage listens on: MINICPMO_GRPC_PORT, else the stage's default port."""
    if os.environ.get("MINICPMO_GRPC_PORT"):
        return int(os.environ["MINICPMO_GRPC_PORT"])
    return DEFAULT_PORTS.get(os.environ.get("MINICPMO_STAGE", ""), 50051)


def _channel(target: str):  # noqa: ANN202 - grpc.Channel, imported lazily
    """Plaintext, or TLS when the stage serves TLS (MINICPMO_TLS_CERT set): the stage is verified against
    MINICPMO_TLS_CA, and the probe presents MINICPMO_TLS_PROBE_CERT/KEY (default: the stage's own
    certificate, which then needs the clientAuth usage) for a stage that requires client certificates."""
    import grpc

    env = os.environ.get
    if not env("MINICPMO_TLS_CERT"):
        return grpc.insecure_channel(target)

    def read(name: str) -> bytes | None:
        path = env(name)
        return open(path, "rb").read() if path else None  # noqa: SIM115 - tiny files, process exits next

    cert = read("MINICPMO_TLS_PROBE_CERT") or read("MINICPMO_TLS_CERT")
    key = read("MINICPMO_TLS_PROBE_KEY") or read("MINICPMO_TLS_KEY")
    creds = grpc.ssl_channel_credentials(read("MINICPMO_TLS_CA"), key, cert)
    return grpc.secure_channel(target, creds)


def check(host: str, port: int, service: str, timeout_s: float) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with _channel(f"{host}:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--port", type=int, default=None, help="default: $MINICPMO_GRPC_PORT or the stage default"
    )
    parser.add_argument("--service", default="", help='health service name ("" = the whole server)')
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    port = args.port if args.port is not None else default_port()
    ok, status = check(args.host, port, args.service, args.timeout)
    print(f"{args.host}:{port} {status}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
