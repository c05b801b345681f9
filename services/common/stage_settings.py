"""How a stage process takes its deploy-profile section: defaults for its engine flags, and its GPU memory cap.

A stage is started three ways: by the embedded launcher (``minicpmo-serve``), by a container runtime
(compose / Helm, whose image entrypoint fills the same variable from ``MINICPMO_DEPLOY_PROFILE``), or by
hand. The first two hand the process its resolved profile section as JSON in
:data:`~services.common.deploy_profile.STAGE_SETTINGS_ENV`. This module turns that section into

* defaults for the stage's own engine flags (``max_num_seqs`` → ``--max-num-seqs`` / ``--max-streams`` /
  ``--max-batch``, ...), so a container that only names a profile gets the profile's limits while a flag
  given on the command line still wins;
* a per-process cap on the CUDA caching allocator (``memory_fraction``), so stages sharing one GPU cannot
  starve each other whatever order they start in. ``--memory-fraction`` overrides the profile's value.

The cap applies to memory PyTorch allocates (weights, caches, activations, CUDA-graph pools); the CUDA
context and library workspaces outside the caching allocator come on top, which is why the bundled
profiles leave part of each card unassigned.
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.common import slow_steps
from services.common.deploy_profile import STAGE_SETTINGS_ENV, apply_memory_fraction, stage_settings_from_env
from services.common.gpu_sharing import MPS_REFUSED_MESSAGE, mps_refused, set_client_priority

MEMORY_FRACTION_FLAG = "--memory-fraction"

# Profile key -> argparse destination of the flag it provides a default for, per stage CLI.
PROFILE_FLAG_DESTS: dict[str, dict[str, str]] = {
    "thinker": {
        "max_num_seqs": "max_num_seqs",
        "max_model_len": "max_context",
        "dtype": "dtype",
        "duplex_window": "duplex_window",
        "duplex_window_high": "duplex_window_high",
        "duplex_window_low": "duplex_window_low",
        "weights": "weights",
        "kv_cache": "kv_cache",
        "kernels": "kernels",
        "kernel_table": "kernel_table",
        "fp8_table": "fp8_table",
        "slow_step_ms": "slow_step_ms",
        "gpu_priority": "gpu_priority",
        "prefix_caching": "prefix_caching",
        "max_step_tokens": "max_step_tokens",
        "whisper_graphs": "whisper_graphs",
    },
    "talker": {
        "max_num_seqs": "max_streams",
        "dtype": "dtype",
        "kernels": "kernels",
        "steps_per_replay": "steps_per_replay",
        "slow_step_ms": "slow_step_ms",
        "gpu_priority": "gpu_priority",
    },
    "code2wav": {"max_num_seqs": "max_batch", "slow_step_ms": "slow_step_ms", "gpu_priority": "gpu_priority"},
}


def check_memory_fraction(value: Any, where: str) -> float:
    """``value`` as a float in (0, 1], or ValueError naming ``where`` (a flag or a profile key)."""
    try:
        fraction = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: must be a number in (0, 1], got {value!r}") from None
    if isinstance(value, bool) or math.isnan(fraction) or not 0 < fraction <= 1:
        raise ValueError(f"{where}: must be in (0, 1], got {value!r}")
    return fraction


def memory_fraction_arg(text: str) -> float:
    """argparse ``type=`` for ``--memory-fraction``: a bad value becomes a usage error, not a traceback."""
    try:
        return check_memory_fraction(text, MEMORY_FRACTION_FLAG)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{MEMORY_FRACTION_FLAG}: ")) from None


def add_memory_fraction_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        MEMORY_FRACTION_FLAG,
        type=memory_fraction_arg,
        default=None,
        metavar="F",
        help=(
            "share of the GPU's memory this process may allocate, in (0, 1] (CUDA only); default: the "
            f"deploy profile's memory_fraction from ${STAGE_SETTINGS_ENV}, else no cap"
        ),
    )


@dataclass(frozen=True)
class MemoryFractionChoice:
    """The fraction a stage runs with and the setting it came from (for the startup log and errors)."""

    fraction: float | None
    # What an operator changes to move the cap: "--memory-fraction" or "stages.<stage>.memory_fraction".
    key: str = MEMORY_FRACTION_FLAG

    @property
    def source(self) -> str:
        return self.key if self.key == MEMORY_FRACTION_FLAG else f"{self.key} via {STAGE_SETTINGS_ENV}"


def resolve_memory_fraction(
    stage: str, cli_value: float | None, settings: Mapping[str, Any] | None
) -> MemoryFractionChoice:
    """``--memory-fraction`` wins over the profile section; neither means no cap."""
    if cli_value is not None:
        return MemoryFractionChoice(
            check_memory_fraction(cli_value, MEMORY_FRACTION_FLAG), MEMORY_FRACTION_FLAG
        )
    key = f"stages.{stage}.memory_fraction"
    if settings and settings.get("memory_fraction") is not None:
        where = f"{STAGE_SETTINGS_ENV}: {key}"
        return MemoryFractionChoice(check_memory_fraction(settings["memory_fraction"], where), key)
    return MemoryFractionChoice(None, key)


def parse_stage_args(
    parser: argparse.ArgumentParser, stage: str, argv: Sequence[str] | None
) -> tuple[argparse.Namespace, MemoryFractionChoice]:
    """Parse ``argv`` with the profile section (if any) as defaults for the stage's engine flags.

    Returns the arguments and the memory fraction in force (:func:`resolve_memory_fraction`); a bad
    value in the environment is a usage error like a bad flag.
    """
    try:
        settings = stage_settings_from_env(stage)
    except ValueError as exc:  # not JSON
        parser.error(f"{STAGE_SETTINGS_ENV} is not valid JSON: {exc}")
    if settings:
        defaults = {
            dest: settings[key]
            for key, dest in PROFILE_FLAG_DESTS[stage].items()
            if settings.get(key) is not None
        }
        parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    try:
        choice = resolve_memory_fraction(stage, args.memory_fraction, settings)
        slow_steps.configure(args.slow_step_ms)
        set_client_priority(args.gpu_priority)
    except ValueError as exc:
        parser.error(str(exc))
    return args, choice


def apply_memory_cap(
    stage: str, device: str, choice: MemoryFractionChoice, log: logging.Logger
) -> float | None:
    """Cap the caching allocator on CUDA and log it; returns the fraction in force (None on CPU / no cap).

    Call before the weights load, so they count against the cap like everything after them.
    """
    if choice.fraction is None:
        if device.startswith("cuda"):
            log.info(
                "%s: no GPU memory cap (no %s, no memory_fraction in the profile)",
                stage,
                MEMORY_FRACTION_FLAG,
            )
        return None
    if not device.startswith("cuda"):
        log.info(
            "%s: memory fraction %.3g from %s ignored on %s", stage, choice.fraction, choice.source, device
        )
        return None
    import torch

    try:
        apply_memory_fraction({"memory_fraction": choice.fraction}, device)  # CUDA's first initialisation
    except RuntimeError as exc:
        if mps_refused(str(exc)):
            raise SystemExit(f"{stage}: {MPS_REFUSED_MESSAGE}") from exc
        raise
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    log.info(
        "%s: GPU memory capped at %.3g of %s = %.1f GiB of %.1f GiB (from %s)",
        stage,
        choice.fraction,
        device,
        choice.fraction * total / 2**30,
        total / 2**30,
        choice.source,
    )
    return choice.fraction
