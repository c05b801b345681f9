"""``minicpmo-checkpoint make``: write a complete random-weight checkpoint in the real layout."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .config_templates import SIZES, build_config, build_generation_config, build_preprocessor_config
from .token2wav_assets import write_token2wav_assets
from .tokenizer_synth import write_tokenizer_files
from .weights import all_specs, print_progress, write_sharded_weights

# Full-size shards are packed up to this many bytes (the real checkpoint ships ~4-5 GB shards).
DEFAULT_FULL_SHARD_GB = 4.0
# Bumped whenever the bytes written for a given (size, seed) change, so cached checkpoints can be refreshed.
GENERATOR_VERSION = 1
MANIFEST = "minicpmo_checkpoint_manifest.json"


def read_manifest(root: str | Path) -> dict[str, Any] | None:
    """The generator's manifest of a checkpoint directory, or None (e.g. a real download)."""
    path = Path(root) / MANIFEST
    try:
        manifest: dict[str, Any] = json.loads(path.read_text())
        return manifest
    except (OSError, json.JSONDecodeError):
        return None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _prepare_out_dir(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and any(out_dir.iterdir()):
        if not force:
            raise FileExistsError(f"{out_dir} exists and is not empty; pass --force to overwrite it")
        if not (out_dir / "config.json").is_file():
            # Refuse to wipe a directory that does not look like a checkpoint, even with --force.
            raise FileExistsError(f"{out_dir} is not empty and has no config.json; refusing to delete it")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)


def dir_size_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def make_checkpoint(
    out_dir: str | Path,
    *,
    size: str = "tiny",
    seed: int = 0,
    device: str = "cpu",
    force: bool = False,
    max_shard_gb: float | None = None,
    log: Callable[[str], None] = print_progress,
) -> Path:
    """Generate the checkpoint; deterministic for (size, seed, device).

    ``max_shard_gb=None`` means: tiny splits ``llm.`` | rest into two shards, full packs 4 GB shards.
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"--device {device} requested but CUDA is not available")
    out = Path(out_dir).expanduser().resolve()
    _prepare_out_dir(out, force)
    t0 = time.monotonic()
    log(f"minicpmo-checkpoint make: size={size} seed={seed} device={device} -> {out}")

    cfg = build_config(size)
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", build_generation_config())
    _write_json(out / "preprocessor_config.json", build_preprocessor_config())

    n_tokens = write_tokenizer_files(out)
    log(f"  tokenizer: {n_tokens} entries ({time.monotonic() - t0:.1f} s)")

    specs = all_specs(cfg)
    n_params = sum(int(torch.Size(s.shape).numel()) for s in specs)
    log(f"  weights: {len(specs)} tensors, {n_params / 1e9:.3f} B params, bf16")
    if max_shard_gb is None and size == "full":
        max_shard_gb = DEFAULT_FULL_SHARD_GB
    max_bytes = None if max_shard_gb is None else int(max_shard_gb * 2**30)
    write_sharded_weights(out, specs, seed=seed, device=device, max_shard_bytes=max_bytes, log=log)

    write_token2wav_assets(out, size, seed, device, log=log)
    # Written last: its presence means the directory is complete.
    _write_json(
        out / MANIFEST,
        {
            "generator": "minicpmo-checkpoint",
            "generator_version": GENERATOR_VERSION,
            "size": size,
            "seed": seed,
            "device": device.split(":")[0],
        },
    )
    log(f"done in {time.monotonic() - t0:.1f} s, {dir_size_bytes(out) / 2**20:.1f} MiB on disk")
    return out
