"""Deploy profiles: one YAML file that says where each stage runs and with which defaults.

A profile is read by three consumers, so it lives in ``services/common`` and depends on nothing heavy:

* the embedded launcher (``minicpmo-serve``) starts one process per stage replica with the device, port
  and ``CUDA_VISIBLE_DEVICES`` the profile gives;
* the gateway fills every stage ``Open`` message with the profile's sampling defaults, hidden-state
  chunking and codec window sizes, and enforces its media/concurrency limits;
* deployment tooling (compose, Helm) reads the same file, e.g. through
  ``python -m services.common.deploy_profile show FILE`` which prints the resolved profile as JSON.

Format (``version: 1``; every key optional except ``stages``; unknown keys are errors so typos surface)::

    version: 1
    name: minicpmo_4_5
    description: free text
    served_model_name: openbmb/MiniCPM-o-4_5
    gateway:   {port, max_concurrent_requests, max_realtime_sessions, max_body_bytes, request_timeout_s, media: {...}}
    stages:
      thinker:  {devices: [cuda:0], memory_fraction: 0.40, max_num_seqs: 8, max_model_len: 40960,
                 dtype: bfloat16, port: 50051, sampling: {...}, hidden_chunk_tokens: 10,
                 first_hidden_chunk_tokens: 11, hidden_dtype: bfloat16}
      talker:   {devices, memory_fraction, max_num_seqs, max_model_len, dtype, port, sampling: {...},
                 codec: {window_frames: 25, left_context_frames: 3, first_window_frames: 25}}
      code2wav: {devices, memory_fraction, max_num_seqs, dtype, port}

``devices`` has one entry per replica (``cpu``, ``cuda`` or ``cuda:N``), so ``[cuda:0, cuda:1]`` means two
replicas, one per GPU. A replica on ``cuda:N`` is started with ``CUDA_VISIBLE_DEVICES=N`` and
``--device cuda``: each process sees exactly one GPU and cannot allocate on a neighbour's. Replica ``k``
listens on ``port + REPLICA_PORT_STRIDE * k`` (metrics on that + 1000, the stage default).

Stage processes read their section (memory share, max sequences) from the environment variable
:data:`STAGE_SETTINGS_ENV`, which the launcher (and, in containers, the image entrypoint) sets to the
stage's resolved JSON; see :func:`stage_settings_from_env` and :mod:`services.common.stage_settings`,
which turns it into flag defaults and a per-process CUDA memory cap.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

STAGES: tuple[str, ...] = ("thinker", "talker", "code2wav")
DEFAULT_STAGE_PORTS: dict[str, int] = {"thinker": 50051, "talker": 50052, "code2wav": 50053}
DEFAULT_SERVED_MODEL_NAME = "openbmb/MiniCPM-o-4_5"
# Replica k of a stage listens on port + 10*k; the three stages' base ports differ by 1, so replicas of
# different stages never collide below 10 replicas each.
REPLICA_PORT_STRIDE = 10
STAGE_SETTINGS_ENV = "MINICPMO_STAGE_SETTINGS"
CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "deploy"
DEFAULT_PROFILE = "minicpmo_4_5"

# Sampling keys each stage's Open message understands (thinker SamplingParams / TalkerSampling fields).
THINKER_SAMPLING_KEYS = frozenset(
    {"temperature", "top_p", "top_k", "repetition_penalty", "seed", "max_tokens", "min_tokens", "ignore_eos"}
)
TALKER_SAMPLING_KEYS = frozenset(
    {"temperature", "top_p", "top_k", "repetition_penalty", "seed", "min_new_frames", "max_new_frames",
     "fixed_frames"}
)
_INT_SAMPLING_KEYS = frozenset(
    {"top_k", "seed", "max_tokens", "min_tokens", "min_new_frames", "max_new_frames", "fixed_frames"}
)
_DTYPES = frozenset({"bfloat16", "float16", "float32"})


class ProfileError(ValueError):
    """A deploy profile is malformed; the message names the file and the offending key."""


@dataclass(frozen=True)
class CodecWindows:
    """Talker → code2wav windowing (model-spec §5.4): new frames per window, left context, first window."""

    window_frames: int = 25
    left_context_frames: int = 3
    first_window_frames: int = 25


@dataclass(frozen=True)
class StageProfile:
    """Placement and defaults of one stage; ``devices`` has one entry per replica."""

    name: str
    devices: tuple[str, ...] = ("cpu",)
    port: int = 0
    memory_fraction: float | None = None
    max_num_seqs: int = 4
    max_model_len: int | None = None
    dtype: str = "bfloat16"
    sampling: Mapping[str, Any] = field(default_factory=dict)
    # thinker only: hidden-state rows per SpeechChunk after the first, and of the first chunk
    hidden_chunk_tokens: int = 10
    first_hidden_chunk_tokens: int = 11
    hidden_dtype: str = "bfloat16"
    # talker only
    codec: CodecWindows = field(default_factory=CodecWindows)

    @property
    def replicas(self) -> int:
        return len(self.devices)

    def replica_port(self, index: int) -> int:
        return self.port + REPLICA_PORT_STRIDE * index

    def settings_json(self) -> str:
        """What the launcher hands the stage process in :data:`STAGE_SETTINGS_ENV`."""
        data = asdict(self)
        data["devices"] = list(self.devices)
        data["sampling"] = dict(self.sampling)
        return json.dumps(data, sort_keys=True)


@dataclass(frozen=True)
class MediaLimits:
    """Per-request media limits the gateway enforces before anything reaches a stage."""

    video_fps: float = 1.0
    video_max_frames: int = 128
    max_images: int = 64
    max_audios: int = 64
    max_videos: int = 1
    max_audio_seconds: float = 600.0
    max_video_seconds: float = 600.0
    max_image_pixels: int = 40_000_000
    max_media_bytes: int = 100 * 1024 * 1024


@dataclass(frozen=True)
class GatewayProfile:
    port: int = 8099
    max_concurrent_requests: int = 16
    # Realtime duplex sessions admitted at once; each holds a persistent thinker sequence.
    max_realtime_sessions: int = 4
    max_body_bytes: int = 64 * 1024 * 1024
    request_timeout_s: float = 600.0
    media: MediaLimits = field(default_factory=MediaLimits)


@dataclass(frozen=True)
class DeployProfile:
    name: str
    description: str = ""
    served_model_name: str = DEFAULT_SERVED_MODEL_NAME
    gateway: GatewayProfile = field(default_factory=GatewayProfile)
    stages: Mapping[str, StageProfile] = field(default_factory=dict)
    source: str = ""

    def stage(self, name: str) -> StageProfile:
        return self.stages[name]

    def with_device(self, device: str) -> DeployProfile:
        """Force every replica onto ``device`` (``cpu`` or ``cuda``), keeping replica counts.

        ``cuda`` keeps the profile's explicit GPU indices when it has them; a profile written for CPU
        gets ``cuda:0`` for every replica.
        """
        device = _check_device(device, "--device")
        stages: dict[str, StageProfile] = {}
        for name, sp in self.stages.items():
            if device == "cpu":
                devices = tuple("cpu" for _ in sp.devices)
            elif device == "cuda":
                devices = tuple(d if d.startswith("cuda") else "cuda:0" for d in sp.devices)
            else:
                devices = tuple(device for _ in sp.devices)
            stages[name] = replace(sp, devices=devices)
        return replace(self, stages=stages)

    def with_overrides(self, overrides: Mapping[str, Any]) -> DeployProfile:
        """Deep-merge ``{"thinker": {...}, "gateway": {...}}`` into the profile and re-validate."""
        raw = self.to_dict()
        for key, value in overrides.items():
            if key in STAGES:
                raw["stages"][key] = _deep_merge(raw["stages"][key], value, f"overrides.{key}")
            elif key in ("gateway", "served_model_name", "description"):
                raw[key] = _deep_merge(raw[key], value, f"overrides.{key}") if isinstance(raw[key], dict) else value
            else:
                raise ProfileError(f"stage overrides: unknown key {key!r} (expected one of {list(STAGES)} or gateway)")
        return parse_profile(raw, source=self.source + " + overrides")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("source")
        data["version"] = 1
        for name, sp in data["stages"].items():
            sp.pop("name")
            sp["devices"] = list(sp["devices"])
            sp["sampling"] = dict(sp["sampling"])
            if name != "thinker":
                for key in ("hidden_chunk_tokens", "first_hidden_chunk_tokens", "hidden_dtype"):
                    sp.pop(key)
            if name != "talker":
                sp.pop("codec")
            if name == "code2wav":
                sp.pop("sampling")
        return data


def _deep_merge(base: Any, update: Any, where: str) -> Any:
    if not isinstance(update, Mapping):
        return copy.deepcopy(update)
    if not isinstance(base, Mapping):
        raise ProfileError(f"{where}: cannot merge a mapping into {type(base).__name__}")
    merged = dict(base)
    for k, v in update.items():
        merged[k] = _deep_merge(merged[k], v, f"{where}.{k}") if isinstance(merged.get(k), Mapping) else copy.deepcopy(v)
    return merged


def _check_device(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ProfileError(f"{where}: device must be a string like 'cpu', 'cuda' or 'cuda:3', got {value!r}")
    if value in ("cpu", "cuda"):
        return value
    if value.startswith("cuda:") and value[5:].isdigit():
        return value
    raise ProfileError(f"{where}: device must be 'cpu', 'cuda' or 'cuda:N', got {value!r}")


def _take(raw: Mapping[str, Any], allowed: dict[str, type | tuple[type, ...]], where: str) -> dict[str, Any]:
    """Type-check ``raw`` against ``allowed`` (key -> accepted types); unknown keys are errors."""
    if not isinstance(raw, Mapping):
        raise ProfileError(f"{where}: expected a mapping, got {type(raw).__name__}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in allowed:
            raise ProfileError(f"{where}: unknown key {key!r} (allowed: {sorted(allowed)})")
        types = allowed[key]
        if value is None:
            continue
        if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
            raise ProfileError(f"{where}.{key}: expected {types}, got a boolean")
        if not isinstance(value, types):
            raise ProfileError(f"{where}.{key}: expected {types}, got {type(value).__name__} {value!r}")
        out[key] = value
    return out


def _positive(value: float, where: str) -> None:
    if value <= 0:
        raise ProfileError(f"{where}: must be positive, got {value}")


def _parse_sampling(raw: Any, allowed_keys: frozenset[str], where: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ProfileError(f"{where}: expected a mapping of sampling parameters")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in allowed_keys:
            raise ProfileError(f"{where}: unknown sampling key {key!r} (allowed: {sorted(allowed_keys)})")
        if key == "ignore_eos":
            if not isinstance(value, bool):
                raise ProfileError(f"{where}.{key}: expected a boolean")
        elif key in _INT_SAMPLING_KEYS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ProfileError(f"{where}.{key}: expected a non-negative integer, got {value!r}")
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ProfileError(f"{where}.{key}: expected a non-negative number, got {value!r}")
            value = float(value)
        out[key] = value
    return out


def _parse_stage(name: str, raw: Any, where: str) -> StageProfile:
    num = (int, float)
    fields = _take(
        raw if raw is not None else {},
        {
            "devices": list,
            "device": str,
            "replicas": int,
            "port": int,
            "memory_fraction": num,
            "max_num_seqs": int,
            "max_model_len": int,
            "dtype": str,
            "sampling": dict,
            "hidden_chunk_tokens": int,
            "first_hidden_chunk_tokens": int,
            "hidden_dtype": str,
            "codec": dict,
            "notes": str,
        },
        where,
    )
    fields.pop("notes", None)
    if "devices" in fields and ("device" in fields or "replicas" in fields):
        raise ProfileError(f"{where}: give either 'devices' (one per replica) or 'device' + 'replicas', not both")
    if "devices" in fields:
        devices = tuple(_check_device(d, f"{where}.devices[{i}]") for i, d in enumerate(fields.pop("devices")))
    else:
        device = _check_device(fields.pop("device", "cpu"), f"{where}.device")
        replicas = fields.pop("replicas", 1)
        _positive(replicas, f"{where}.replicas")
        devices = tuple(device for _ in range(replicas))
    if not devices:
        raise ProfileError(f"{where}.devices: at least one replica is needed")
    fields["devices"] = devices
    fields.setdefault("port", DEFAULT_STAGE_PORTS[name])
    if not 0 < fields["port"] < 65536 - 1000:
        raise ProfileError(f"{where}.port: {fields['port']} is not a usable port (metrics use port + 1000)")
    if "memory_fraction" in fields and not 0 < fields["memory_fraction"] <= 1:
        raise ProfileError(f"{where}.memory_fraction: must be in (0, 1], got {fields['memory_fraction']}")
    for key in ("max_num_seqs", "max_model_len", "hidden_chunk_tokens", "first_hidden_chunk_tokens"):
        if key in fields:
            _positive(fields[key], f"{where}.{key}")
    for key in ("dtype", "hidden_dtype"):
        if key in fields and fields[key] not in _DTYPES:
            raise ProfileError(f"{where}.{key}: expected one of {sorted(_DTYPES)}, got {fields[key]!r}")
    if name != "thinker":
        for key in ("hidden_chunk_tokens", "first_hidden_chunk_tokens", "hidden_dtype"):
            if key in fields:
                raise ProfileError(f"{where}.{key}: only the thinker exports hidden states")
    if name != "talker" and "codec" in fields:
        raise ProfileError(f"{where}.codec: codec windows are a talker setting")
    if name == "code2wav" and "sampling" in fields:
        raise ProfileError(f"{where}.sampling: code2wav has no sampling parameters")
    allowed = THINKER_SAMPLING_KEYS if name == "thinker" else TALKER_SAMPLING_KEYS
    fields["sampling"] = _parse_sampling(fields.get("sampling"), allowed, f"{where}.sampling")
    if "codec" in fields:
        codec = _take(
            fields["codec"],
            {"window_frames": int, "left_context_frames": int, "first_window_frames": int},
            f"{where}.codec",
        )
        for key, value in codec.items():
            if value < (0 if key == "left_context_frames" else 1):
                raise ProfileError(f"{where}.codec.{key}: out of range ({value})")
        fields["codec"] = CodecWindows(**codec)
    return StageProfile(name=name, **fields)


def parse_profile(raw: Any, source: str = "<dict>") -> DeployProfile:
    """Validate a loaded YAML/JSON document and build a :class:`DeployProfile`."""
    top = _take(
        raw,
        {
            "version": int,
            "name": str,
            "description": str,
            "served_model_name": str,
            "gateway": dict,
            "stages": dict,
        },
        source,
    )
    if top.get("version", 1) != 1:
        raise ProfileError(f"{source}: unsupported profile version {top['version']} (this build reads 1)")
    stages_raw = top.get("stages")
    if not stages_raw:
        raise ProfileError(f"{source}: 'stages' is required (thinker, talker, code2wav)")
    unknown = set(stages_raw) - set(STAGES)
    if unknown:
        raise ProfileError(f"{source}: unknown stages {sorted(unknown)} (expected {list(STAGES)})")
    missing = [s for s in STAGES if s not in stages_raw]
    if missing:
        raise ProfileError(f"{source}: stages missing: {missing}")
    stages = {s: _parse_stage(s, stages_raw[s], f"{source}: stages.{s}") for s in STAGES}

    gw_raw = _take(
        top.get("gateway") or {},
        {
            "port": int,
            "max_concurrent_requests": int,
            "max_realtime_sessions": int,
            "max_body_bytes": int,
            "request_timeout_s": (int, float),
            "media": dict,
        },
        f"{source}: gateway",
    )
    media_types: dict[str, type | tuple[type, ...]] = {
        "video_fps": (int, float),
        "video_max_frames": int,
        "max_images": int,
        "max_audios": int,
        "max_videos": int,
        "max_audio_seconds": (int, float),
        "max_video_seconds": (int, float),
        "max_image_pixels": int,
        "max_media_bytes": int,
    }
    media_raw = _take(gw_raw.pop("media", {}), media_types, f"{source}: gateway.media")
    for key, value in {**gw_raw, **media_raw}.items():
        if key.startswith("max_") and key in ("max_images", "max_audios", "max_videos"):
            if value < 0:
                raise ProfileError(f"{source}: gateway.media.{key} must be >= 0")
        else:
            _positive(value, f"{source}: gateway.{key}")
    gateway = GatewayProfile(**gw_raw, media=MediaLimits(**media_raw))
    name = top.get("name") or Path(source).stem
    return DeployProfile(
        name=name,
        description=top.get("description", "").strip(),
        served_model_name=top.get("served_model_name", DEFAULT_SERVED_MODEL_NAME),
        gateway=gateway,
        stages=stages,
        source=source,
    )


def resolve_profile_path(name_or_path: str | os.PathLike[str] | None) -> Path:
    """A file path, or a bundled profile name (``minicpmo_4_5_2gpu``, ``cpu``, ...)."""
    if name_or_path is None:
        name_or_path = DEFAULT_PROFILE
    path = Path(name_or_path)
    if path.is_file():
        return path
    for candidate in (CONFIG_DIR / f"{name_or_path}.yaml", CONFIG_DIR / f"minicpmo_4_5_{name_or_path}.yaml"):
        if candidate.is_file():
            return candidate
    bundled = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise ProfileError(f"deploy profile {str(name_or_path)!r} not found (bundled profiles: {bundled})")


def load_profile(name_or_path: str | os.PathLike[str] | None = None) -> DeployProfile:
    """Read and validate a profile file (or a bundled profile by name)."""
    path = resolve_profile_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: not valid YAML: {exc}") from exc
    return parse_profile(raw, source=str(path))


def parse_overrides(text: str | None) -> dict[str, Any]:
    """``--stage-overrides`` JSON: ``{"thinker": {"max_num_seqs": 2}, "talker": {"sampling": {...}}}``."""
    if not text:
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"--stage-overrides is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ProfileError("--stage-overrides must be a JSON object keyed by stage name")
    return data


def stage_settings_from_env(stage: str) -> dict[str, Any] | None:
    """The stage section the launcher passed to this process, or None when started by hand."""
    text = os.environ.get(STAGE_SETTINGS_ENV)
    if not text:
        return None
    data = json.loads(text)
    if data.get("name") != stage:
        return None
    return data


def apply_memory_fraction(settings: Mapping[str, Any] | None, device: str) -> None:
    """Cap this process's CUDA caching allocator at the profile's memory share (no-op on CPU)."""
    if not settings or not settings.get("memory_fraction") or not device.startswith("cuda"):
        return
    import torch

    index = int(device.split(":", 1)[1]) if ":" in device else 0
    torch.cuda.set_per_process_memory_fraction(float(settings["memory_fraction"]), index)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.common.deploy_profile", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    show = sub.add_parser("show", help="validate a profile and print it resolved, as JSON")
    show.add_argument("profile", help="file path or bundled profile name")
    show.add_argument("--stage-overrides", default=None)
    show.add_argument("--device", choices=["cpu", "cuda"], default=None)
    sub.add_parser("list", help="list bundled profiles")
    args = parser.parse_args(argv)
    if args.cmd == "list":
        for path in sorted(CONFIG_DIR.glob("*.yaml")):
            print(path.stem)
        return 0
    try:
        profile = load_profile(args.profile)
        if args.device:
            profile = profile.with_device(args.device)
        profile = profile.with_overrides(parse_overrides(args.stage_overrides))
    except ProfileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    data = profile.to_dict()
    for name, sp in profile.stages.items():
        data["stages"][name]["replica_ports"] = [sp.replica_port(i) for i in range(sp.replicas)]
    print(json.dumps(data, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
