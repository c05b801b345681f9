"""How stage processes placed on the same GPU share it: time-slicing (CUDA's default) or one MPS server.

Why: without MPS, the CUDA contexts of the thinker, talker and code2wav processes on one GPU take turns
(time-slicing): a kernel of one process never runs beside a kernel of another, and a process whose
small kernels are queued waits for the others' slices. With 16 realtime sessions on one H200 that
doubled the thinker's decode step (forward 11.7 ms against ~5.4 ms alone) and tripled its host part
(4.8 ms, the policy draw waiting for a slice). Under one MPS server the three processes' kernels share
the SMs concurrently: in the same run the step fell to 8.0 / 1.4 ms and the unit RTF p90 from 0.644 to
0.393 (BENCHMARKS.md, "GPU sharing: MPS"). So a profile that puts several stages on one GPU says
``gpu_sharing: mps``, and the launcher starts an MPS control daemon private to that deployment.

The daemon gets its own pipe and log directories (nothing of the GPU's settings changes: compute mode,
clocks and MIG stay as they are). When ``CUDA_MPS_PIPE_DIRECTORY`` is already set, a daemon run by the
host (or Kubernetes' device plugin) is in charge and none is started. When the daemon cannot start
(``nvidia-cuda-mps-control`` missing, e.g. a container without the driver's utilities), the stages
time-slice as before and the reason is logged: MPS is a speed-up, never a reason not to serve.

MPS trade-off (docs/deploy.md): the clients of one MPS server share its fault domain, so a fatal GPU
error (an illegal memory access) in one stage can end the other stages' CUDA contexts too, and after a
client is lost that way (a SIGKILL counts) the server refuses new clients until all of its clients have
exited; the launcher therefore restarts such a stage together with the server's other clients
(``gateway.launcher.Supervisor.restart_mps_group``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.common.deploy_profile import DeployProfile

MODES = ("time_slice", "mps")
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
# An MPS client's scheduling priority (0 normal, 1 below normal), read by CUDA when the process creates
# its context; the MPS server prefers pending work of normal clients. Without MPS it has no effect.
PRIORITY_ENV = "CUDA_MPS_CLIENT_PRIORITY"
PRIORITIES = ("normal", "below_normal")
CONTROL_BINARY = "nvidia-cuda-mps-control"
# What CUDA says when an MPS server refuses a new client (cudaErrorMpsServerNotReady, 807): after a client
# was lost mid-work it takes none until all of its clients have exited. The launcher reads a dead stage's
# log for these (a stage exits with MPS_REFUSED_MESSAGE, which carries the first).
MPS_REFUSED_SIGNS = ("MPS server is not ready", "Error 807")
MPS_REFUSED_MESSAGE = (
    "the MPS server is not ready to accept new clients (cudaErrorMpsServerNotReady): a client of it was "
    "lost mid-work, and it takes no new client until all of its clients have exited. Restart every stage "
    "that shares this GPU (minicpmo-serve does so by itself; with docker compose: docker compose restart "
    "thinker talker code2wav)"
)
START_TIMEOUT_S = 30.0


def shared_gpus(profile: DeployProfile) -> list[str]:
    """CUDA devices that host more than one stage replica (a bare ``cuda`` counts as ``cuda:0``)."""
    count: Counter[str] = Counter()
    for sp in profile.stages.values():
        for device in sp.devices:
            if device.startswith("cuda"):
                count[device if ":" in device else "cuda:0"] += 1
    return sorted(d for d, n in count.items() if n > 1)


class MpsDaemon:
    """An MPS control daemon private to one deployment (own pipe/log directories under ``root``).

    The pipe path must stay short: the daemon's unix sockets live there and a socket path is limited to
    108 bytes, hence a ``tempfile.mkdtemp`` directory under /tmp by default.
    """

    def __init__(self, root: Path | None = None) -> None:
        self._own_root = root is None  # a directory made here is removed again by stop()
        self.root = root or Path(tempfile.mkdtemp(prefix="minicpmo-mps-"))
        self.env = {PIPE_ENV: str(self.root / "pipe"), LOG_ENV: str(self.root / "log")}
        self.started = False

    def start(self) -> str | None:
        """Start the daemon; None on success, else why not (the caller falls back to time-slicing)."""
        binary = shutil.which(CONTROL_BINARY)
        if binary is None:
            return f"{CONTROL_BINARY} is not on PATH"
        for path in self.env.values():
            Path(path).mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run(
                [binary, "-d"],
                env={**os.environ, **self.env},
                check=True,
                timeout=START_TIMEOUT_S,
                capture_output=True,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{CONTROL_BINARY} -d failed: {exc}"
        self.started = True
        return None

    def stop(self) -> None:
        """Ask the daemon to quit (its server exits once the stages have), then remove the directory made
        for it, if this object made it; safe to call twice."""
        if self.started:
            self.started = False
            binary = shutil.which(CONTROL_BINARY) or CONTROL_BINARY
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(
                    [binary],
                    input="quit\n",
                    text=True,
                    env={**os.environ, **self.env},
                    timeout=START_TIMEOUT_S,
                    capture_output=True,
                )
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)


def start_sharing(
    profile: DeployProfile, log: Callable[[str], None] = print, root: Path | None = None
) -> tuple[str, MpsDaemon | None]:
    """Apply the profile's ``gpu_sharing``: (what the stages will run under, in words; the daemon started).

    The daemon's :attr:`MpsDaemon.env` must reach every stage process on a GPU (the launcher adds it to
    their environment); the caller stops the daemon after the stages have exited.
    """
    if not any(d.startswith("cuda") for sp in profile.stages.values() for d in sp.devices):
        return "no GPU", None
    gpus = shared_gpus(profile)
    if not gpus:
        return "one stage process per GPU", None
    if profile.gpu_sharing != "mps":
        return f"separate processes time-slicing {', '.join(gpus)}", None
    if os.environ.get(PIPE_ENV):
        return f"MPS clients of the daemon at {os.environ[PIPE_ENV]} (not started here)", None
    daemon = MpsDaemon(root)
    reason = daemon.start()
    if reason is not None:
        daemon.stop()  # removes its directory
        log(f"gpu_sharing mps: {reason}; the stages time-slice {', '.join(gpus)} instead")
        return f"separate processes time-slicing {', '.join(gpus)} (MPS unavailable: {reason})", None
    return f"MPS clients of a private daemon ({daemon.env[PIPE_ENV]})", daemon


def mps_refused(text: str) -> bool:
    """Whether ``text`` (a CUDA error, a stage's log) says an MPS server refused a new client."""
    return any(sign in text for sign in MPS_REFUSED_SIGNS)


def set_client_priority(priority: str) -> None:
    """Make this process an MPS client of ``priority`` (``normal`` | ``below_normal``).

    Why: the stages on one GPU are not equally urgent. The thinker's unit decode and the talker's first
    frames decide when a reply starts, while code2wav's later windows have the slack of the audio already
    sent; a below-normal client's kernels wait while normal clients have work pending, instead of
    sharing the SMs evenly. Call before the process touches CUDA (the stage CLIs do, right after parsing
    their arguments). ``normal`` leaves the environment as it is (an operator's own setting stays).
    """
    if priority not in PRIORITIES:
        raise ValueError(f"gpu_priority must be one of {PRIORITIES}, got {priority!r}")
    if priority == "below_normal":
        os.environ[PRIORITY_ENV] = "1"
