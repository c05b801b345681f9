"""Launching the whole pipeline for a benchmark, and tearing it down whatever happens.

The stage processes and the gateway are started with the launcher's own child plan
(:func:`gateway.launcher.plan_children`) on free ports; :func:`guarded_run` makes sure SIGTERM (sent by
``timeout``), Ctrl-C or an error still stops every child. Shared by :mod:`bench.e2e`, :mod:`bench.cancel`,
:mod:`bench.reliability` and :mod:`bench.realtime_duplex`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.chat_workload import Workload
from services.common.deploy_profile import STAGES, DeployProfile, load_profile, parse_overrides
from services.common.gpu_sharing import MpsDaemon


class BenchAbort(Exception):
    """SIGTERM/SIGINT or the overall deadline: stop, tear down, write what was measured."""


def resolve_profile(args: argparse.Namespace, w: Workload) -> DeployProfile:
    profile = load_profile(args.deploy_config)
    if args.device:
        profile = profile.with_device(args.device)
    overrides = parse_overrides(args.stage_overrides)
    thinker = dict(overrides.get("thinker", {}))
    thinker.setdefault("first_hidden_chunk_tokens", w.first_chunk_tokens)
    overrides["thinker"] = thinker
    gateway = dict(overrides.get("gateway", {}))
    # Admission must not reject the benchmark's own concurrency (429s would count as failures).
    limit = max(args.levels) + 2
    if profile.gateway.max_concurrent_requests < limit:
        gateway["max_concurrent_requests"] = limit
    if gateway:
        overrides["gateway"] = gateway
    return with_gpu_sharing(profile.with_overrides(overrides), args)


def add_gpu_sharing_flags(p: argparse.ArgumentParser) -> None:
    """``--gpu-sharing`` (and its old spelling ``--mps``): how launched stages on one GPU share it."""
    p.add_argument(
        "--gpu-sharing",
        choices=["profile", "mps", "time_slice"],
        default="profile",
        help="stages on one GPU: the profile's gpu_sharing (default), a private MPS daemon, or time-slicing",
    )
    p.add_argument("--mps", dest="gpu_sharing", action="store_const", const="mps", help="= --gpu-sharing mps")


def with_gpu_sharing(profile: DeployProfile, args: argparse.Namespace) -> DeployProfile:
    """``profile`` with ``--gpu-sharing`` applied (``profile`` keeps the profile's own choice)."""
    mode = getattr(args, "gpu_sharing", "profile")
    return profile if mode == "profile" else profile.with_overrides({"gpu_sharing": mode})


def _run_text(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "git_commit": _run_text(["git", "rev-parse", "HEAD"]),
    }
    gpus = _run_text(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    if gpus:
        env["gpus"] = gpus.splitlines()
    for mod in ("torch", "transformers", "grpc", "fastapi", "httpx"):
        with contextlib.suppress(Exception):
            env[f"{mod}_version"] = __import__(mod).__version__
    with contextlib.suppress(Exception):
        import torch

        env["cuda_version"] = torch.version.cuda
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_stage_args(items: list[str]) -> dict[str, list[str]]:
    """``--stage-args thinker='--kv-budget 16G'`` (repeatable) -> extra argv per stage."""
    out: dict[str, list[str]] = {}
    for item in items:
        stage, sep, rest = item.partition("=")
        if not sep or stage not in STAGES:
            raise SystemExit(f"--stage-args {item!r}: expected STAGE=ARGS with STAGE in {list(STAGES)}")
        out.setdefault(stage, []).extend(shlex.split(rest))
    return out


def stage_args_for(args: argparse.Namespace, profile: DeployProfile) -> dict[str, list[str]]:
    """``--stage-args`` plus the thinker's ``--kv-budget`` on CUDA when ``--thinker-kv-budget`` names one.

    The default, ``auto``, passes nothing: the thinker sizes its pool from its memory cap (the profile's
    ``memory_fraction`` of the card it finds, minus the weights and a headroom), which fits an 80 GB H100
    and a 141 GB H200 alike. A given budget is checked against that cap at start (a clear KVBudgetError
    in the stage log instead of an out-of-memory error)."""
    stage_args = parse_stage_args(args.stage_args)
    on_cuda = any(d.startswith("cuda") for s in STAGES for d in profile.stage(s).devices)
    if on_cuda and args.thinker_kv_budget != "auto" and "--kv-budget" not in stage_args.get("thinker", []):
        stage_args.setdefault("thinker", []).extend(["--kv-budget", args.thinker_kv_budget])
    return stage_args


class Pipeline:
    """The launcher's children for one profile, on free ports, with logs under ``log_dir``."""

    def __init__(
        self, profile: DeployProfile, checkpoint: Path, log_dir: Path, stage_args: dict[str, list[str]]
    ) -> None:
        from gateway.launcher import Supervisor, pick_free_stage_ports, plan_children

        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        profile_file = log_dir / "profile.yaml"
        profile_file.write_text(yaml.safe_dump(profile.to_dict(), sort_keys=False))
        self.port = free_port()
        # The gateway's port is free again once free_port() returns: keep the stages off it, or the OS may
        # hand it to one of them (a CI run lost code2wav to "address already in use" on the gateway's port).
        stage_ports = pick_free_stage_ports(profile, avoid={self.port})
        children = plan_children(
            profile, checkpoint.resolve(), profile_file, self.port, stage_ports=stage_ports
        )
        for child in children:
            if child.stage is not None:
                child.argv += stage_args.get(child.stage, [])
        self.children = children
        self.supervisor = Supervisor(children, log_dir)
        self.url = f"http://127.0.0.1:{self.port}"
        self.profile = profile
        self.gpu_sharing = ""  # how the stages share their GPUs, in words (set by start)
        self._mps: MpsDaemon | None = None

    def start(self) -> None:
        """Apply the profile's GPU sharing (a private MPS daemon for ``gpu_sharing: mps``), then start."""
        from gateway.launcher import share_gpus

        self.gpu_sharing, self._mps = share_gpus(self.profile, self.children, lambda m: print(f"[e2e] {m}"))
        print(f"[e2e] GPU sharing: {self.gpu_sharing}", flush=True)
        for child in self.children:
            print(
                f"[e2e] start {child.name} on {child.device} port {child.port}: {' '.join(child.argv[2:])}",
                flush=True,
            )
            self.supervisor.start(child)
        pids = {c.name: self.supervisor.procs[c.name].pid for c in self.children}
        (self.log_dir / "pids.json").write_text(json.dumps(pids))

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until the gateway's /health is 200 (every stage serving); raises if a child dies."""
        import httpx

        t0 = time.monotonic()
        last_note = t0
        while True:
            self.supervisor.check_alive()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=3).status_code == 200:
                    return time.monotonic() - t0
            now = time.monotonic()
            if now - t0 > timeout_s:
                tails = "\n".join(self.supervisor.tail(c) for c in self.children)
                raise TimeoutError(f"pipeline not healthy after {timeout_s:.0f} s\n{tails}")
            if now - last_note >= 10:
                print(f"[e2e] waiting for health ... {now - t0:.0f} s", flush=True)
                last_note = now
            time.sleep(1.0)

    def stop(self) -> None:
        print("[e2e] stopping the pipeline", flush=True)
        self.supervisor.stop()
        if self._mps is not None:
            self._mps.stop()
            self._mps = None


def _install_signal_handlers() -> None:
    def _abort(signum: int, _frame: object) -> None:
        raise BenchAbort(f"received signal {signum}")

    signal.signal(signal.SIGTERM, _abort)
    signal.signal(signal.SIGINT, _abort)


@dataclass
class RunOutcome:
    """What :func:`guarded_run` hands the bench body: its exit code and the teardown steps to run."""

    rc: int = 0
    teardown: list[Any] = field(default_factory=list)  # callables, run last-registered first


@contextlib.contextmanager
def guarded_run(report: dict[str, Any], tag: str) -> Any:
    """Run a bench body that launches processes: SIGTERM/SIGINT abort it (rc 3), launch and I/O errors
    are recorded in ``report`` (rc 1; an HTTP client error that escaped a request's own handling too), and
    the registered teardown always runs, shielded from signals so
    that no stage process is left behind half-stopped."""
    outcome = RunOutcome()
    _install_signal_handlers()
    try:
        yield outcome
    except BenchAbort as exc:
        report["status"] = f"aborted: {exc}"
        outcome.rc = 3
    except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError, httpx.HTTPError) as exc:
        report["status"] = f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        report["error_detail"] = str(exc)
        print(f"[{tag}] error: {exc}", file=sys.stderr, flush=True)
        outcome.rc = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # teardown must not be interrupted halfway
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for stop in reversed(outcome.teardown):
            stop()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def add_launch_flags(p: argparse.ArgumentParser, stage_args_example: str = "") -> None:
    """The flags every benchmark that launches the pipeline takes (profile, device, per-stage extras)."""
    p.add_argument(
        "--checkpoint", required=True, help="checkpoint directory (full-size random for GPU numbers)"
    )
    p.add_argument("--deploy-config", default="minicpmo_4_5", help="profile file or bundled name")
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default=None, help="force every stage onto this device"
    )
    p.add_argument(
        "--stage-overrides", default=None, help="JSON deep-merged into the profile (as minicpmo-serve)"
    )
    p.add_argument(
        "--stage-args",
        action="append",
        default=[],
        metavar="STAGE=ARGS",
        help="extra CLI flags for a stage process, e.g. thinker='--kv-budget 16G' (repeatable)",
    )
    p.add_argument(
        "--thinker-kv-budget",
        default="auto",
        help="thinker --kv-budget on CUDA, e.g. 12G (checked against the stage's memory cap at start); "
        "'auto' (default): sized from the profile's memory_fraction of the card",
    )
    p.add_argument("--startup-timeout", type=float, default=420.0)
    add_gpu_sharing_flags(p)
