"""``minicpmo-serve``: the embedded deployment - three stage processes and the gateway on one machine.

    minicpmo-serve [--checkpoint DIR] [--deploy-config FILE|NAME] [--stage-overrides JSON]
                   [--device cpu|cuda] [--port 8099] [--stage-ports profile|auto]
                   [--max-concurrent-requests N] [--max-realtime-sessions N]

* Without ``--checkpoint`` it generates the tiny random-weight checkpoint once
  (``minicpmo-checkpoint make --size tiny``) and caches it under ``$XDG_CACHE_HOME/minicpmo`` (default
  ``~/.cache/minicpmo``), so a newcomer sees the whole pipeline answer on a laptop.
* Without ``--deploy-config`` it uses the 1-GPU profile when CUDA is available, else the CPU profile.
* Every stage replica is a child process ``python -m services.<stage> --checkpoint DIR --device D
  --port P`` plus the profile's engine knobs (:func:`stage_flags`). A replica placed on ``cuda:N`` runs
  with ``CUDA_VISIBLE_DEVICES=N`` and ``--device cuda:0``, so it sees exactly its own GPU; CPU replicas
  run with ``CUDA_VISIBLE_DEVICES=""``. Each child also gets its resolved profile section in
  ``MINICPMO_STAGE_SETTINGS`` (memory share, max sequences, dtype); the memory share is also passed as
  ``--memory-fraction``, which each stage applies as a per-process CUDA allocator cap.
* Every port is checked before any child starts (:func:`plan_ports`): a taken one stops the launch with
  exit status 1 naming it, or with ``--stage-ports auto`` (the default without ``--checkpoint``) free
  stage ports are picked instead.
* The gateway child gets every replica's address (``ip:port`` lists, balanced round-robin) and the
  resolved profile (overrides applied) as a YAML file.
* Stages that share a GPU share it as the profile's ``gpu_sharing`` says: with ``mps`` a private MPS
  control daemon is started first and every stage replica on a GPU is its client
  (:mod:`services.common.gpu_sharing`; stopped after the stages).
* It waits until every stage answers its gRPC health check and the gateway's ``/health`` is 200, prints
  the URL, and then supervises: a child that exits (a stage crash, an OOM kill) is started again on the
  same port after a backoff (1 s, doubling to 30 s while it keeps dying within a minute of its start;
  it gives up, stopping everything with exit code 1, after 5 such quick deaths in a row). The gateway's
  channels reconnect by themselves, so nothing else restarts, with one exception: an MPS client killed
  by a signal leaves its MPS server refusing new clients until all of them have exited, so the other
  stages of that server are stopped and restarted with it (:meth:`Supervisor.restart_mps_group`).
* Ctrl-C / SIGTERM stops the tree in order, exit code 0: the gateway first (it stops admitting, closes
  realtime sessions with ``session.closed{server_shutdown}`` and lets in-flight requests finish for up
  to its graceful-shutdown time), and only once it has exited the stages (each drains, then exits);
  whatever is still running after its timeout gets SIGKILL, to its whole process group.

The child plan is a pure function (:func:`plan_children`) so tests can check placements without GPUs.
The file is about 800 lines on purpose: plan, start, supervise and ordered stop share the child
specs and the process-group handling, and a reader checking the shutdown order should see all of it here.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import faulthandler
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gateway import logs
from gateway.auth import API_KEY_ENV, ApiKeyError, is_loopback, resolve_api_key
from services.common.deploy_profile import (
    STAGE_SETTINGS_ENV,
    DeployProfile,
    StageProfile,
    TLSProfile,
    load_profile,
    parse_overrides,
)
from services.common.deploy_schema import STAGES, ProfileError, port_arg
from services.common.gpu_sharing import PIPE_ENV, MpsDaemon, mps_refused, start_sharing

log = logging.getLogger("minicpmo.launcher")


def _say(message: str, **_: object) -> None:
    """One launcher log line (JSON, see gateway.logs, once main() has configured logging)."""
    log.info(message)


CHECKPOINT_MAKE_TIMEOUT_S = 900
RESTART_BASE_S = 1.0  # delay before the restart after a second quick death; doubles per further one
RESTART_MAX_S = 30.0
STABLE_S = 60.0  # a child that ran this long before dying starts its backoff from scratch
MAX_QUICK_DEATHS = 5
# The gateway gets its drain grace (profile gateway.drain_grace_s / --drain-grace) plus this much to end
# what the grace could not finish and to close (gateway.shutdown) before it is killed.
GATEWAY_STOP_MARGIN_S = 15.0
STAGE_STOP_S = 40.0  # a stage drains for up to --drain-timeout (30 s) before it exits
# The other MPS clients of a server that refuses new clients (see Supervisor.restart_mps_group) get this
# long to exit on SIGTERM before SIGKILL: their requests are failing anyway, the point is to serve again.
MPS_GROUP_STOP_S = 10.0


@dataclass
class ChildSpec:
    """One process to start: what it is, its command line, the environment it adds, and where it listens."""

    name: str  # "thinker-0", "talker-1", "gateway"
    stage: str | None
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    device: str = "cpu"


def _device_env(device: str) -> tuple[str, dict[str, str]]:
    """(--device value, env) for a replica placed on ``device``."""
    if device == "cpu":
        return "cpu", {"CUDA_VISIBLE_DEVICES": ""}
    if device.startswith("cuda:"):
        return "cuda:0", {"CUDA_VISIBLE_DEVICES": device.split(":", 1)[1]}
    return "cuda", {}  # bare "cuda": whatever GPUs the launcher itself sees


def stage_flags(sp: StageProfile) -> list[str]:
    """The profile's engine knobs as each stage CLI spells them (checked against --help by the tests).

    The stage would also take them from ``MINICPMO_STAGE_SETTINGS``; spelling them out keeps the child's
    command line (``ps``, the log) self-explanatory.
    """
    extra = ["--memory-fraction", f"{sp.memory_fraction:g}"] if sp.memory_fraction is not None else []
    # Keys the bundled profiles leave at their defaults: spelled out only when a profile sets them.
    if sp.slow_step_ms != StageProfile.slow_step_ms:
        extra = ["--slow-step-ms", f"{sp.slow_step_ms:g}", *extra]
    if sp.name != "code2wav" and sp.kernels != "auto":
        extra = ["--kernels", sp.kernels, *extra]
    if sp.name == "thinker" and sp.kernel_table:
        extra = ["--kernel-table", sp.kernel_table, *extra]
    if sp.name == "thinker" and sp.fp8_table:
        extra = ["--fp8-table", sp.fp8_table, *extra]
    if sp.name == "thinker" and sp.max_step_tokens != StageProfile.max_step_tokens:
        extra = ["--max-step-tokens", str(sp.max_step_tokens), *extra]
    if sp.name == "talker" and sp.steps_per_replay is not None:
        extra = ["--steps-per-replay", str(sp.steps_per_replay), *extra]
    if sp.name == "thinker":
        flags = ["--dtype", sp.dtype, "--max-num-seqs", str(sp.max_num_seqs)]
        if sp.max_model_len:
            flags += ["--max-context", str(sp.max_model_len)]
        flags += ["--duplex-window", sp.duplex_window]
        if sp.duplex_window == "basic":
            flags += [
                "--duplex-window-high",
                str(sp.duplex_window_high),
                "--duplex-window-low",
                str(sp.duplex_window_low),
            ]
        flags += ["--weights", sp.weights, "--kv-cache", sp.kv_cache]
        flags += ["--prefix-caching" if sp.prefix_caching else "--no-prefix-caching"]
        flags += ["--whisper-graphs" if sp.whisper_graphs else "--no-whisper-graphs"]
        return flags + extra
    if sp.name == "talker":
        return ["--dtype", sp.dtype, "--max-streams", str(sp.max_num_seqs), *extra]
    return ["--max-batch", str(sp.max_num_seqs), *extra]  # code2wav: windows vocoded per engine step


def tls_flags(tls: TLSProfile | None) -> list[str]:
    """A stage's ``--tls-*`` flags for the profile's ``tls`` section (none: plaintext)."""
    if tls is None:
        return []
    flags = ["--tls-cert", tls.cert_file, "--tls-key", tls.key_file]
    return flags + (["--tls-client-ca", tls.ca_file] if tls.require_client_cert else [])


def plan_children(
    profile: DeployProfile,
    checkpoint: str | os.PathLike[str],
    profile_file: str | os.PathLike[str],
    gateway_port: int,
    host: str = "127.0.0.1",
    python: str = sys.executable,
    stage_ports: dict[str, list[int]] | None = None,
    gateway_args: Sequence[str] = (),
) -> list[ChildSpec]:
    """Every child process for ``profile``: stage replicas first (thinker, talker, code2wav), gateway last."""
    children: list[ChildSpec] = []
    addrs: dict[str, list[str]] = {}
    for stage in STAGES:
        sp = profile.stage(stage)
        ports = stage_ports[stage] if stage_ports else [sp.replica_port(i) for i in range(sp.replicas)]
        for index, device in enumerate(sp.devices):
            dev_arg, env = _device_env(device)
            env[STAGE_SETTINGS_ENV] = sp.settings_json()
            env["PYTHONUNBUFFERED"] = "1"
            argv = [
                python,
                "-m",
                f"services.{stage}",
                "--checkpoint",
                str(checkpoint),
                "--device",
                dev_arg,
                "--host",
                host,
                "--port",
                str(ports[index]),
                *stage_flags(sp),
                *tls_flags(profile.tls),
            ]
            children.append(ChildSpec(f"{stage}-{index}", stage, argv, env, ports[index], device))
            addrs.setdefault(stage, []).append(f"{host}:{ports[index]}")
    gw_argv = [
        python,
        "-m",
        "gateway",
        "--thinker-addr",
        ",".join(addrs["thinker"]),
        "--talker-addr",
        ",".join(addrs["talker"]),
        "--code2wav-addr",
        ",".join(addrs["code2wav"]),
        "--deploy-config",
        str(profile_file),
        "--host",
        host,
        "--port",
        str(gateway_port),
        *gateway_args,
    ]
    children.append(
        ChildSpec(
            "gateway",
            None,
            gw_argv,
            {"PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""},
            gateway_port,
            "cpu",
        )
    )
    return children


def share_gpus(
    profile: DeployProfile, children: list[ChildSpec], log: Callable[[str], None] = print
) -> tuple[str, MpsDaemon | None]:
    """Apply the profile's ``gpu_sharing`` (:mod:`services.common.gpu_sharing`) to the stage children:
    with a private MPS daemon started, every stage replica on a GPU becomes its client. Returns how the
    GPUs are shared (in words, for the log and the bench reports) and the daemon to stop last."""
    mode, daemon = start_sharing(profile, log)
    if daemon is not None:
        for child in children:
            if child.stage is not None and child.device.startswith("cuda"):
                child.env.update(daemon.env)
    return mode, daemon


# ---- checkpoint ---------------------------------------------------------------------------------
def cache_dir() -> Path:
    """Where the tiny checkpoint is cached: ``$XDG_CACHE_HOME/minicpmo`` (the XDG base-directory rule
    every Linux tool follows; default ``~/.cache/minicpmo``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "minicpmo"


def ensure_tiny_checkpoint(log: Callable[..., None] = print) -> Path:
    """The cached tiny checkpoint, generated on first use (atomic: a half-written one is never used)."""
    target = cache_dir() / "tiny-ckpt"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="tiny-ckpt.", dir=target.parent))
    log(f"[minicpmo-serve] generating the tiny checkpoint in {target} (once, ~10-30 s)")
    cmd = [
        sys.executable,
        "-m",
        "services.common.checkpoint_tool",
        "make",
        str(staging / "ckpt"),
        "--size",
        "tiny",
    ]
    try:
        subprocess.run(cmd, check=True, timeout=CHECKPOINT_MAKE_TIMEOUT_S, stdout=subprocess.DEVNULL)
        if (target / "config.json").is_file():  # another launcher won the race
            return target
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging / "ckpt", target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# ---- ports --------------------------------------------------------------------------------------
class PortsTaken(SystemExit):
    """Ports the launch needs are taken: exits the launcher with status 1 and a message naming them."""

    def __init__(self, taken: Sequence[str], host: str) -> None:
        super().__init__(
            f"minicpmo-serve: {'; '.join(taken)} already in use on {host}. Free it, choose another "
            "(--port for the gateway; the profile's or --stage-overrides' port for a stage), or let the "
            "launcher pick free stage ports with --stage-ports auto"
        )


def _port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a listener could bind ``host:port`` now. SO_REUSEADDR as servers set it, so a port left in
    TIME_WAIT by a process that just exited counts as free; a live listener (even one with SO_REUSEPORT,
    as gRPC's default) does not."""
    if not 0 < port < 65536:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def plan_ports(
    profile: DeployProfile, mode: str, host: str, gateway_port: int
) -> dict[str, list[int]] | None:
    """The stage ports for :func:`plan_children`: None (the profile's) or free ones (``mode`` ``auto``).

    Checked before any child starts, so a taken port stops the launch at once with its number instead of
    a stage failing minutes later, after loading its weights: the gateway's port, and with the profile's
    ports every replica's gRPC port and its metrics port (gRPC port + 1000). Raises :class:`PortsTaken`.
    """
    taken = [] if _port_free(gateway_port, host) else [f"gateway port {gateway_port}"]
    if mode == "auto":
        if taken:
            raise PortsTaken(taken, host)
        return pick_free_stage_ports(profile, host, avoid={gateway_port})
    for stage in STAGES:
        sp = profile.stage(stage)
        for index in range(sp.replicas):
            port = sp.replica_port(index)
            if not _port_free(port, host):
                taken.append(f"{stage}-{index} port {port}")
            if not _port_free(port + 1000, host):
                taken.append(f"{stage}-{index} metrics port {port + 1000}")
    if taken:
        raise PortsTaken(taken, host)
    return None


def pick_free_stage_ports(
    profile: DeployProfile, host: str = "127.0.0.1", avoid: set[int] | None = None
) -> dict[str, list[int]]:
    """Free ports for every replica such that port + 1000 (its metrics port) is free too; none of them,
    nor their metrics ports, in ``avoid`` (the gateway's port)."""
    taken: set[int] = set(avoid or ())
    out: dict[str, list[int]] = {}
    for stage in STAGES:
        for _ in range(profile.stage(stage).replicas):
            for _attempt in range(200):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((host, 0))
                    port = s.getsockname()[1]
                if (
                    port < 64000
                    and port not in taken
                    and port + 1000 not in taken
                    and _port_free(port + 1000, host)
                ):
                    break
            else:
                raise RuntimeError("could not find free ports for the stages")
            taken.update({port, port + 1000})
            out.setdefault(stage, []).append(port)
    return out


# ---- health -------------------------------------------------------------------------------------
def _stage_serving(port: int, stage: str, tls: TLSProfile | None = None) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from gateway.stage_clients import STAGE_SERVICES
    from services.common.tls import ClientTLS

    target = f"127.0.0.1:{port}"
    if tls is None:
        channel = grpc.insecure_channel(target)
    else:
        creds = ClientTLS(tls.ca_file, tls.client_cert_file, tls.client_key_file).credentials()
        channel = grpc.secure_channel(target, creds)
    with channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=STAGE_SERVICES[stage]), timeout=1.0
            )
        except grpc.RpcError:
            return False
    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


def _gateway_healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=3) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM if the launcher dies without cleaning up (e.g. SIGKILL)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def restart_delay(quick_deaths: int) -> float:
    """Seconds before restarting a child that died ``quick_deaths`` times in a row within ``STABLE_S`` of
    its start: none the first time (a crash or an OOM kill: serve again as soon as possible), then 1 s
    doubling to ``RESTART_MAX_S`` (a child that cannot start must not spin)."""
    if quick_deaths <= 1:
        return 0.0
    return min(RESTART_MAX_S, RESTART_BASE_S * 2.0 ** (quick_deaths - 2))


class Supervisor:
    """Starts, watches and stops the children."""

    def __init__(
        self,
        children: list[ChildSpec],
        log_dir: Path | None,
        verbose: bool = False,
        tls: TLSProfile | None = None,
    ) -> None:
        self.children = children
        self.tls = tls  # for the start-up health probes of the stages
        self.log_dir = log_dir
        self.verbose = verbose
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.started_at: dict[str, float] = {}
        self.quick_deaths: dict[str, int] = {}
        self.restart_due: dict[str, float] = {}
        self.restarts: dict[str, int] = {}

    def log_path(self, child: ChildSpec) -> Path | None:
        return self.log_dir / f"{child.name}.log" if self.log_dir else None

    def start(self, child: ChildSpec) -> None:
        env = {**os.environ, **child.env}
        path = self.log_path(child)
        out = None if (self.verbose or path is None) else open(path, "wb")  # noqa: SIM115 - owned by the child
        self.started_at[child.name] = time.monotonic()
        try:
            self.procs[child.name] = subprocess.Popen(
                child.argv,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,  # noqa: PLW1509
            )
        finally:
            if out is not None:
                out.close()

    def check_alive(self) -> None:
        for child in self.children:
            proc = self.procs.get(child.name)
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited with code {proc.returncode}\n{self.tail(child)}")

    def supervise(self, now: float | None = None, log: Callable[..., None] | None = None) -> None:
        """Restart children that exited: at once the first time, with backoff while one keeps dying
        within a minute of its start; raises RuntimeError once one keeps dying. A dead MPS client that
        leaves its server refusing new clients takes the server's other clients with it
        (:meth:`restart_mps_group`).

        Called every 0.1 s by the launcher's main loop (after start-up).
        """
        now = time.monotonic() if now is None else now
        log = log or _say
        for child in self.children:
            proc = self.procs.get(child.name)
            if proc is None or proc.poll() is None:
                continue
            due = self.restart_due.get(child.name)
            if due is None:
                ran = now - self.started_at.get(child.name, now)
                quick = self.quick_deaths.get(child.name, 0) + 1 if ran < STABLE_S else 1
                self.quick_deaths[child.name] = quick
                if quick > MAX_QUICK_DEATHS:
                    raise RuntimeError(
                        f"{child.name} died {quick - 1} times in a row within {STABLE_S:.0f} s "
                        f"of starting; giving up\n{self.tail(child)}"
                    )
                delay = restart_delay(quick)
                due = self.restart_due[child.name] = now + delay
                log(
                    f"[minicpmo-serve] {child.name} exited with code {proc.returncode} after {ran:.0f} s; "
                    f"restarting {'now' if delay == 0 else f'in {delay:g} s'}",
                    flush=True,
                )
                if self.mps_refuses_after(child, proc.returncode):
                    self.restart_mps_group(child, due, log)
            if now >= due:
                del self.restart_due[child.name]
                self.restarts[child.name] = self.restarts.get(child.name, 0) + 1
                self.start(child)
                log(
                    f"[minicpmo-serve] restarted {child.name} on port {child.port} "
                    f"pid {self.procs[child.name].pid}",
                    flush=True,
                )

    def mps_group(self, child: ChildSpec) -> list[ChildSpec]:
        """The stage children that are clients of the same MPS server as ``child`` (itself included);
        empty when it is not an MPS client."""
        pipe = child.env.get(PIPE_ENV)
        if child.stage is None or not pipe:
            return []
        return [c for c in self.children if c.stage is not None and c.env.get(PIPE_ENV) == pipe]

    def mps_refuses_after(self, child: ChildSpec, returncode: int) -> bool:
        """Whether ``child``'s death leaves its MPS server refusing new clients: it was an MPS client and
        was killed by a signal (SIGKILL, an OOM kill, a segfault: the server treats the lost client as a
        fatal fault), or its log says its own context was refused (cudaErrorMpsServerNotReady)."""
        if len(self.mps_group(child)) < 2:
            return False
        return returncode < 0 or mps_refused(self.tail(child))

    def restart_mps_group(self, child: ChildSpec, due: float, log: Callable[..., None]) -> None:
        """Stop the other clients of ``child``'s MPS server and restart them with it at ``due``.

        Why: after a fatal fault, and the loss of a client killed mid-work is one, an MPS server keeps
        serving the clients it has but refuses every new one (``cudaErrorMpsServerNotReady``) until all
        of its clients have exited; then it recreates its GPU contexts. Measured on an H100: code2wav
        SIGKILLed under load, its five restarts over 80 s were all refused while the thinker and the
        talker stayed connected, and the launcher gave up. So the only way back is a restart of every
        client of that server: they get SIGTERM (their streams drain or fail, as they would on a stop)
        and ``MPS_GROUP_STOP_S`` before SIGKILL, and start again together with the dead one; these
        restarts do not count as quick deaths of their own.
        """
        others = [
            c
            for c in self.mps_group(child)
            if c is not child and (p := self.procs.get(c.name)) is not None and p.poll() is None
        ]
        if not others:
            return
        names = ", ".join(c.name for c in others)
        log(
            f"[minicpmo-serve] {child.name} was an MPS client: its MPS server takes no new client until "
            f"all of its clients have exited; stopping {names} to restart them with it",
            flush=True,
        )
        self._stop_group(others, MPS_GROUP_STOP_S)
        for other in others:
            self.restart_due[other.name] = due

    def tail(self, child: ChildSpec, lines: int = 30) -> str:
        path = self.log_path(child)
        if path is None or not path.is_file():
            return ""
        text = path.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(f"  [{child.name}] {line}" for line in text)

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = {c.name for c in self.children}
        while pending:
            self.check_alive()
            for child in self.children:
                if child.name not in pending:
                    continue
                if child.stage is None:
                    ok = _gateway_healthy(child.port)
                else:
                    ok = _stage_serving(child.port, child.stage, self.tls)
                if ok:
                    pending.discard(child.name)
            if not pending:
                return
            if time.monotonic() > deadline:
                tails = "\n".join(self.tail(c) for c in self.children if c.name in pending)
                raise TimeoutError(f"not healthy after {timeout_s:.0f} s: {sorted(pending)}\n{tails}")
            time.sleep(0.5)

    def stop(
        self, gateway_timeout_s: float = 30.0 + GATEWAY_STOP_MARGIN_S, stage_timeout_s: float = STAGE_STOP_S
    ) -> None:
        """Gateway first, and the stages only once it has exited: in-flight requests finish against live
        stages. SIGTERM each group, then SIGKILL (to the child's whole process group) after its timeout."""
        self.restart_due.clear()
        self._stop_group([c for c in self.children if c.stage is None], gateway_timeout_s)
        self._stop_group([c for c in self.children if c.stage is not None], stage_timeout_s)

    def _stop_group(self, group: list[ChildSpec], timeout_s: float) -> None:
        for child in group:
            proc = self.procs.get(child.name)
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in group:
            proc = self.procs.get(child.name)
            if proc is None:
                continue
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _say(f"[minicpmo-serve] {child.name} did not stop within {timeout_s:g} s; killing it")
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: its pid is its group id
                proc.wait(timeout=5)


def _cuda_device_count() -> int:
    """CUDA devices the driver shows this process (``CUDA_VISIBLE_DEVICES`` applies), asked through the
    driver library itself: the launcher stays free of torch, like the gateway it starts."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def _default_profile_name(device: str | None) -> str:
    if device == "cpu":
        return "cpu"
    if device == "cuda":
        return "minicpmo_4_5"
    return "minicpmo_4_5" if _cuda_device_count() > 0 else "cpu"


def cli_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``--stage-overrides`` with the gateway flags merged in (a flag wins over the same key in the JSON);
    the profile validates the values as it validates a file's (a ``--port`` out of range included)."""
    overrides = parse_overrides(args.stage_overrides)
    capacity = {
        key: value
        for key, value in (
            ("port", args.port),
            ("max_concurrent_requests", args.max_concurrent_requests),
            ("max_realtime_sessions", args.max_realtime_sessions),
        )
        if value is not None
    }
    if capacity:
        gateway = overrides.get("gateway")
        overrides["gateway"] = {**(gateway if isinstance(gateway, dict) else {}), **capacity}
    return overrides


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="minicpmo-serve", description="Run the three MiniCPM-o stages and the gateway"
    )
    p.add_argument("--checkpoint", default=None, help="checkpoint directory (default: generate the tiny one)")
    p.add_argument(
        "--deploy-config", default=None, help="profile file or bundled name (default: 1 GPU, or cpu)"
    )
    p.add_argument(
        "--stage-overrides", default=None, help='JSON, e.g. {"thinker": {"sampling": {"max_tokens": 64}}}'
    )
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default=None, help="force every stage onto this device"
    )
    p.add_argument("--port", type=port_arg, default=None, help="gateway port (default: the profile's, 8099)")
    p.add_argument("--host", default="127.0.0.1", help="address the gateway and stages bind")
    p.add_argument(
        "--stage-ports",
        choices=["profile", "auto"],
        default=None,
        help="stage ports from the profile (50051..) or free ports picked at start (default: auto for the "
        "tiny demo, i.e. without --checkpoint, else profile); a taken profile port stops the launch",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        metavar="N",
        help="chat completions served at once, more get 429 (profile gateway.max_concurrent_requests)",
    )
    p.add_argument(
        "--max-realtime-sessions",
        type=int,
        default=None,
        metavar="N",
        help="realtime sessions admitted at once (profile gateway.max_realtime_sessions)",
    )
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for every child")
    p.add_argument("--log-dir", default=None, help="child logs (default: a fresh temp dir)")
    p.add_argument("--verbose", action="store_true", help="children log to this terminal instead of files")
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--api-key-file",
        default=None,
        help=f"file holding the gateway's API key (or set {API_KEY_ENV}); handed to the gateway in its "
        "environment, never on its command line",
    )
    p.add_argument(
        "--api-key", default=None, help=f"the key itself (discouraged: visible in ps; use {API_KEY_ENV})"
    )
    p.add_argument(
        "--allow-insecure",
        action="store_true",
        help="let the gateway serve a non-loopback --host without an API key",
    )
    p.add_argument(
        "--drain-grace",
        type=float,
        default=None,
        help="seconds in-flight requests may finish after SIGTERM (default: profile gateway.drain_grace_s, 30)",
    )
    p.add_argument("--allowed-media-root", default=None)
    p.add_argument("--enable-http-fetch", action="store_true")
    return p


def gateway_options(
    args: argparse.Namespace, grace_s: float, api_key: str | None
) -> tuple[list[str], dict[str, str]]:
    """The gateway child's extra flags and environment. The API key goes into its environment (readable
    only by its own user), never onto its command line; without a key it must not inherit a
    ``MINICPMO_API_KEY`` from the launcher's environment either."""
    flags: list[str] = []
    for flag, value in (
        ("--served-model-name", args.served_model_name),
        ("--allowed-media-root", args.allowed_media_root),
        ("--drain-grace", f"{grace_s:g}"),
    ):
        if value:
            flags += [flag, value]
    if args.enable_http_fetch:
        flags.append("--enable-http-fetch")
    if args.allow_insecure:
        flags.append("--allow-insecure")
    return flags, {API_KEY_ENV: api_key or ""}


def main(argv: list[str] | None = None) -> int:
    faulthandler.enable()  # a native crash (SIGSEGV in a C extension) prints every thread's stack
    args = build_parser().parse_args(argv)
    logs.configure("info", process="launcher", stream=sys.stdout)
    try:
        profile = load_profile(args.deploy_config or _default_profile_name(args.device))
        if args.device:
            profile = profile.with_device(args.device)
        profile = profile.with_overrides(cli_overrides(args))
        api_key = resolve_api_key(args.api_key, args.api_key_file)
    except (ProfileError, ApiKeyError) as exc:
        print(f"minicpmo-serve: {exc}", file=sys.stderr)
        return 2
    if not is_loopback(args.host) and not api_key and not args.allow_insecure:
        print(
            f"minicpmo-serve: refusing to serve {args.host} (not loopback) without an API key: set "
            f"{API_KEY_ENV} or --api-key-file, or pass --allow-insecure",
            file=sys.stderr,
        )
        return 2
    grace_s = args.drain_grace if args.drain_grace is not None else profile.gateway.drain_grace_s
    checkpoint = Path(args.checkpoint) if args.checkpoint else ensure_tiny_checkpoint()
    if not (checkpoint / "config.json").is_file():
        print(f"minicpmo-serve: {checkpoint} is not a checkpoint (no config.json)", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="minicpmo-serve-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    profile_file = log_dir / "profile.yaml"
    profile_file.write_text(yaml.safe_dump(profile.to_dict(), sort_keys=False))
    port = args.port or profile.gateway.port
    gateway_args, gateway_env = gateway_options(args, grace_s, api_key)
    stage_ports = plan_ports(
        profile, args.stage_ports or ("profile" if args.checkpoint else "auto"), args.host, port
    )
    children = plan_children(
        profile,
        checkpoint.resolve(),
        profile_file,
        port,
        args.host,
        stage_ports=stage_ports,
        gateway_args=gateway_args,
    )
    children[-1].env.update(gateway_env)
    sup = Supervisor(children, None if args.verbose else log_dir, verbose=args.verbose, tls=profile.tls)
    sharing, mps = share_gpus(profile, children, lambda m: _say(f"[minicpmo-serve] {m}"))

    stop_requested = False

    def _on_signal(signum: int, _frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_signal)
    rc = 0
    try:
        _say(
            f"[minicpmo-serve] profile {profile.name}, checkpoint {checkpoint}, logs in {log_dir}; "
            f"GPU sharing: {sharing}"
        )
        for child in children:
            sup.start(child)
            _say(
                f"[minicpmo-serve] start {child.name} on {child.device} port {child.port} "
                f"pid {sup.procs[child.name].pid}"
            )
        sup.wait_healthy(args.startup_timeout)
        _say(
            f"[minicpmo-serve] ready: http://{args.host}:{port}/v1/chat/completions "
            f"(model {args.served_model_name or profile.served_model_name})"
        )
        while True:
            sup.supervise()
            time.sleep(0.1)
    except KeyboardInterrupt:
        _say(f"[minicpmo-serve] stopping: draining the gateway (grace {grace_s:g} s), then the stages")
    except (RuntimeError, TimeoutError) as exc:
        log.error("[minicpmo-serve] failed: %s", exc)
        rc = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sup.stop(gateway_timeout_s=grace_s + GATEWAY_STOP_MARGIN_S)
        if mps is not None:
            mps.stop()  # after the stages: the daemon's server exits once its clients have
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
