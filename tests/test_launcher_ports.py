"""Ports and capacity on the operator's command line: a taken port never hangs the launch.

* A stage's gRPC server binds without SO_REUSEPORT (gRPC's default turns it on, which let a second
  server bind beside a holder, report SERVING and never receive a connection): a taken port is an error
  naming it, and the stage process exits 1.
* ``minicpmo-serve`` checks every port it will use before starting any child: a taken gateway or stage
  port stops it with exit status 1 and a message naming the port, well within 10 s; with
  ``--stage-ports auto`` (the default without ``--checkpoint``) it picks free stage ports instead.
* ``--max-realtime-sessions`` / ``--max-concurrent-requests`` override the profile's gateway keys.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gateway.config import GatewayConfig
from gateway.launcher import PortsTaken, build_parser, cli_overrides, plan_ports
from services.common.deploy_profile import ProfileError, load_profile
from services.common.grpc_server import PortInUseError, ServeOptions, StageServer, serve_forever
from tests.deploy_checks import REPO


@contextmanager
def held_port(port: int = 0) -> Iterator[int]:
    """A loopback listener holding ``port`` (0: a free one) with SO_REUSEPORT set, as a gRPC server
    holds its port by default: only a bind that does not share the port is refused by it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
        yield s.getsockname()[1]


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports below 60000 whose + 1000 (metrics) ports are free too."""
    found: list[int] = []
    while len(found) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 60000 and port not in found and port + 1000 not in found:
            with socket.socket() as m:
                try:
                    m.bind(("127.0.0.1", port + 1000))
                except OSError:
                    continue
            found.append(port)
    return found


def _profile_with_ports(thinker: int, talker: int, code2wav: int):  # noqa: ANN202
    return load_profile("cpu").with_overrides(
        {"thinker": {"port": thinker}, "talker": {"port": talker}, "code2wav": {"port": code2wav}}
    )


def test_a_stage_server_refuses_a_taken_port() -> None:
    async def run(port: int) -> None:
        server = StageServer("thinker", "minicpmo.v1.ThinkerService", lambda s: None, ServeOptions(
            host="127.0.0.1", port=port, metrics_port=0
        ))  # fmt: skip
        with pytest.raises(PortInUseError, match=f"gRPC port {port}"):
            await server.start()
        with pytest.raises(SystemExit) as exited:  # the stage CLI's path: a message and exit status 1
            await serve_forever(server)
        assert exited.value.code == 1

    with held_port() as port:
        asyncio.run(run(port))


def test_a_stage_server_refuses_a_taken_metrics_port() -> None:
    (port,) = _free_ports(1)

    async def run() -> None:
        server = StageServer("talker", "minicpmo.v1.TalkerService", lambda s: None, ServeOptions(
            host="127.0.0.1", port=port
        ))  # fmt: skip
        with pytest.raises(PortInUseError, match=f"metrics port {port + 1000}"):
            await server.start()

    with held_port(port + 1000):
        asyncio.run(run())


def test_profile_ports_that_are_taken_stop_the_plan_naming_them() -> None:
    thinker, talker, code2wav, gateway = _free_ports(4)
    profile = _profile_with_ports(thinker, talker, code2wav)
    assert plan_ports(profile, "profile", "127.0.0.1", gateway) is None  # all free: the profile's ports
    with held_port(talker), held_port(code2wav + 1000), pytest.raises(PortsTaken) as taken:
        plan_ports(profile, "profile", "127.0.0.1", gateway)
    message = str(taken.value.code)
    assert f"talker-0 port {talker}" in message and f"code2wav-0 metrics port {code2wav + 1000}" in message
    assert str(thinker) not in message and "--stage-ports auto" in message
    with held_port(gateway), pytest.raises(PortsTaken, match=f"gateway port {gateway}"):
        plan_ports(profile, "profile", "127.0.0.1", gateway)


def test_auto_stage_ports_step_around_taken_ones() -> None:
    thinker, talker, code2wav, gateway = _free_ports(4)
    profile = _profile_with_ports(thinker, talker, code2wav)
    with held_port(thinker):
        ports = plan_ports(profile, "auto", "127.0.0.1", gateway)
        assert ports is not None
        flat = [p for stage in ports.values() for p in stage]
        assert len(flat) == 3 and thinker not in flat and gateway not in flat
        assert gateway not in {p + 1000 for p in flat}  # nor a replica's metrics port
    with held_port(gateway), pytest.raises(PortsTaken, match=f"gateway port {gateway}"):
        plan_ports(profile, "auto", "127.0.0.1", gateway)  # the gateway's port is the operator's choice


def _launch(tiny_ckpt: Path, tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], float]:
    argv = [
        sys.executable,
        "-m",
        "gateway.launcher",
        "--checkpoint",
        str(tiny_ckpt),
        "--deploy-config",
        "cpu",
    ]
    argv += ["--device", "cpu", "--log-dir", str(tmp_path / "logs"), "--startup-timeout", "60", *extra]
    start = time.monotonic()
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    return out, time.monotonic() - start


def test_the_launcher_exits_naming_a_taken_stage_port(tiny_ckpt: Path, tmp_path: Path) -> None:
    thinker, talker, code2wav, gateway = _free_ports(4)
    overrides = {"thinker": {"port": thinker}, "talker": {"port": talker}, "code2wav": {"port": code2wav}}
    with held_port(thinker):
        out, took = _launch(
            tiny_ckpt, tmp_path, "--port", str(gateway), "--stage-overrides", json.dumps(overrides)
        )
    assert out.returncode == 1, out.stderr[-2000:]
    assert f"thinker-0 port {thinker}" in out.stderr
    assert took < 10, f"took {took:.1f} s"
    assert not (tmp_path / "logs" / "thinker-0.log").exists()  # nothing was started


def test_the_launcher_exits_naming_a_taken_gateway_port(tiny_ckpt: Path, tmp_path: Path) -> None:
    with held_port() as gateway:
        out, took = _launch(tiny_ckpt, tmp_path, "--port", str(gateway), "--stage-ports", "auto")
    assert out.returncode == 1, out.stderr[-2000:]
    assert f"gateway port {gateway}" in out.stderr and took < 10


def test_capacity_flags_override_the_profile() -> None:
    args = build_parser().parse_args(
        [
            "--max-realtime-sessions",
            "7",
            "--max-concurrent-requests",
            "3",
            "--stage-overrides",
            json.dumps({"gateway": {"max_realtime_sessions": 2, "request_timeout_s": 5.0}}),
        ]
    )
    profile = load_profile("cpu").with_overrides(cli_overrides(args))
    assert profile.gateway.max_realtime_sessions == 7  # the flag wins over the JSON
    assert profile.gateway.max_concurrent_requests == 3
    assert profile.gateway.request_timeout_s == 5.0  # the JSON's other keys stay
    # what the launcher writes for the gateway child (its --deploy-config) carries them
    config = GatewayConfig(profile=profile)
    assert (config.realtime_session_limit, config.concurrency_limit) == (7, 3)
    unchanged = load_profile("cpu").with_overrides(cli_overrides(build_parser().parse_args([])))
    assert unchanged.gateway == load_profile("cpu").gateway
    with pytest.raises(ProfileError, match="max_realtime_sessions"):
        load_profile("cpu").with_overrides(
            cli_overrides(build_parser().parse_args(["--max-realtime-sessions", "0"]))
        )
    # --port is the profile's gateway.port, and a profile's port out of range is refused as such
    args = build_parser().parse_args(["--port", "8123"])
    assert load_profile("cpu").with_overrides(cli_overrides(args)).gateway.port == 8123
    args = build_parser().parse_args(["--stage-overrides", json.dumps({"gateway": {"port": 99999}})])
    with pytest.raises(ProfileError, match="gateway.port: 99999 is not a port number"):
        load_profile("cpu").with_overrides(cli_overrides(args))


def test_stage_ports_default_to_auto_only_for_the_tiny_demo() -> None:
    assert build_parser().parse_args([]).stage_ports is None  # main(): auto without --checkpoint
    launcher = (REPO / "gateway" / "launcher.py").read_text()
    assert 'args.stage_ports or ("profile" if args.checkpoint else "auto")' in launcher


def test_port_flags_refuse_what_is_not_a_port_at_parse_time(capsys: pytest.CaptureFixture[str]) -> None:
    """--port of the launcher, the gateway and a stage: argparse refuses a non-port with a one-line reason
    (exit 2), instead of a bind-time OverflowError traceback or a misleading "already in use"."""
    import argparse

    from gateway.app import build_parser as gateway_parser
    from services.common.grpc_server import add_serve_arguments

    def stage_parser() -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser()
        add_serve_arguments(parser, "talker")
        return parser

    for parser, bad in (
        (build_parser(), "99999"),
        (gateway_parser(), "65536"),
        (gateway_parser(), "0"),
        (stage_parser(), "-1"),
        (stage_parser(), "x"),
    ):
        with pytest.raises(SystemExit) as info:
            parser.parse_args(["--port", bad])
        assert info.value.code == 2
        assert "is not a port number" in capsys.readouterr().err
    assert stage_parser().parse_args(["--port", "0"]).port == 0
