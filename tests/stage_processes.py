"""Real stage servers as child processes, for gateway tests that need real failures (a replica that is
down, killed mid-stream, or one of several behind one address).

Each :class:`StageProcess` is ``python -m services.<stage>`` on the tiny checkpoint with its own gRPC port
and Prometheus port, so a test can read what that one replica did (streams opened, streams still
active) from its own ``/metrics``. :func:`start_stages` launches several at once and waits until every
one reports SERVING on the gRPC health service, which is what the gateway's channels wait for too.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.stage_clients import STAGE_SERVICES

REPO = Path(__file__).resolve().parents[1]
_ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dead_address() -> str:
    """A loopback address nobody listens on: connecting to it is refused at once (a stage that is down)."""
    return f"127.0.0.1:{free_port()}"


@dataclass
class StageProcess:
    stage: str
    port: int
    metrics_port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    cmd: list[str] = field(default_factory=list)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def serving(self) -> bool:
        with grpc.insecure_channel(self.addr) as channel:
            try:
                resp = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=STAGE_SERVICES[self.stage]), timeout=1.0
                )
            except grpc.RpcError:
                return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def metric(self, name: str) -> float:
        """``name{stage="<stage>"}`` from this replica's own Prometheus endpoint (0 before first set)."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        m = re.search(rf'^{name}{{stage="{self.stage}"}} ([0-9.e+-]+)$', text, re.M)
        return float(m.group(1)) if m else 0.0

    def counter(self, name: str) -> float:
        """``name`` summed over its label sets from this replica's Prometheus endpoint (0 when absent)."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))

    def streams_opened(self) -> int:
        return int(self.metric("minicpmo_stage_requests_total"))

    def busy(self) -> dict[str, float]:
        """Streams still open and requests still admitted to the engine on this replica."""
        return {
            f"{self.stage}.streams_active": self.metric("minicpmo_stage_streams_active"),
            f"{self.stage}.in_flight": self.metric("minicpmo_stage_in_flight"),
        }

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye - the connection just breaks, as when a node dies."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def restart(self, timeout_s: float = 300.0) -> float:
        """Start the same stage again on the same ports (after :meth:`kill`); returns the monotonic time
        at which it first reported SERVING."""
        assert self.proc.poll() is not None, "restart() needs the process to have exited"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=_ENV, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self.serving():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.stage} did not come back:\n{self.log_path.read_text(errors='replace')[-2000:]}"
                )
            time.sleep(0.1)
        return time.monotonic()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_stages(
    checkpoint: Path, log_dir: Path, specs: list[tuple[str, list[str]]], timeout_s: float = 600.0
) -> list[StageProcess]:
    """Start one process per ``(stage, extra CLI args)`` in parallel; return once all are SERVING."""
    started: list[StageProcess] = []
    try:
        for i, (stage, extra) in enumerate(specs):
            port, metrics_port = free_port(), free_port()
            log_path = log_dir / f"{stage}-{i}.log"
            cmd = [
                sys.executable,
                "-m",
                f"services.{stage}",
                "--checkpoint",
                str(checkpoint),
                "--device",
                "cpu",
                "--port",
                str(port),
                "--metrics-port",
                str(metrics_port),
                "--drain-timeout",
                "2",
                *extra,
            ]
            with log_path.open("wb") as log:
                proc = subprocess.Popen(cmd, cwd=REPO, env=_ENV, stdout=log, stderr=subprocess.STDOUT)
            started.append(StageProcess(stage, port, metrics_port, proc, log_path, cmd))
        deadline = time.monotonic() + timeout_s
        waiting = list(started)
        while waiting:
            waiting = [p for p in waiting if not p.serving()]
            dead = [p for p in started if p.proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(
                    f"--- {p.log_path.name}\n{p.log_path.read_text(errors='replace')[-2000:]}"
                    for p in dead or waiting
                )
                raise RuntimeError(f"stage servers did not become healthy:\n{logs}")
            if waiting:
                time.sleep(0.5)
        return started
    except BaseException:
        stop_all(started)
        raise


def stop_all(stages: list[StageProcess]) -> None:
    """SIGTERM every process still alive (after SIGCONT: a test may have left one stopped)."""
    for p in stages:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGCONT)
            p.proc.terminate()
    for p in stages:
        p.stop()
