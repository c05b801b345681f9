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
    gpu_sharing: mps   # or time_slice (default): how stages placed on one GPU share it (gpu_sharing.py)
    gateway:   {port, max_concurrent_requests, max_realtime_sessions, max_body_bytes, request_timeout_s,
                body_idle_timeout_s, drain_grace_s, default_modalities, media: {...}, transcription: {...}, voice_dir}
    tls:       {ca_file, cert_file, key_file, client_cert_file, client_key_file, require_client_cert}  # optional
    stages:
      thinker:  {devices: [cuda:0], memory_fraction: 0.40, max_num_seqs: 8, max_model_len: 40960,
                 dtype: bfloat16, port: 50051, sampling: {...}, hidden_chunk_tokens: 10,
                 first_hidden_chunk_tokens: 11, hidden_dtype: bfloat16,
                 duplex_window: basic, duplex_window_high: 8000, duplex_window_low: 6000,
                 weights: bf16,   # or fp8: e4m3 projection weights quantized at load
                 kv_cache: bf16,  # or fp8: an e4m3 KV cache
                 prefix_caching: true, kernels: auto, kernel_table: null, fp8_table: null,
                 max_step_tokens: 512, whisper_graphs: false, slow_step_ms: 50}
      talker:   {devices, memory_fraction, max_num_seqs, max_model_len, dtype, port, sampling: {...},
                 codec: {window_frames: 25, left_context_frames: 3, first_window_frames: 25},
                 kernels: auto, steps_per_replay: 4, slow_step_ms: 50}
      code2wav: {devices, memory_fraction, max_num_seqs, dtype, port, slow_step_ms}

Every key, its type, default and range: docs/config.md (generated from these models by
``python -m services.common.config_table``).

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

from services.common.deploy_schema import (
    STAGES,
    Code2WavDoc,
    ProfileError,
    TalkerDoc,
    TalkerSamplingDoc,
    ThinkerDoc,
    ThinkerSamplingDoc,
    check_device,
    validate_document,
)

DEFAULT_STAGE_PORTS: dict[str, int] = {"thinker": 50051, "talker": 50052, "code2wav": 50053}
DEFAULT_SERVED_MODEL_NAME = "openbmb/MiniCPM-o-4_5"
# Replica k of a stage listens on port + 10*k; the three stages' base ports differ by 1, so replicas of
# different stages never collide below 10 replicas each.
REPLICA_PORT_STRIDE = 10
STAGE_SETTINGS_ENV = "MINICPMO_STAGE_SETTINGS"
CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "deploy"
DEFAULT_PROFILE = "minicpmo_4_5"

# Sampling keys each stage's Open message understands (thinker SamplingParams / TalkerSampling fields).
THINKER_SAMPLING_KEYS = frozenset(ThinkerSamplingDoc.model_fields)
THINKER_WINDOW_KEYS = ("duplex_window", "duplex_window_high", "duplex_window_low")
TALKER_SAMPLING_KEYS = frozenset(TalkerSamplingDoc.model_fields)


@dataclass(frozen=True)
class CodecWindows:
    """Talker → code2wav windowing (docs/model.md, Talker streaming and budgets): new frames per window,
    left context, first window."""

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
    # every stage: engine steps slower than this are logged with their phases (0: off)
    slow_step_ms: float = 50.0
    # every stage: under MPS, its GPU work's priority against the other stages' (normal | below_normal)
    gpu_priority: str = "normal"
    # thinker and talker: decode kernel backend, auto | torch | triton
    kernels: str = "auto"
    # thinker only: a microbench table of skinny-GEMM configs (None: the built-in table)
    kernel_table: str | None = None
    # thinker only: a sweep table of fp8 GEMM configs (None: the built-in table)
    fp8_table: str | None = None
    # talker only: decode steps per CUDA-graph replay (None: 4 with graphs, 1 without)
    steps_per_replay: int | None = None
    # thinker only: the duplex sliding context window, on unless a profile turns it off, so a long call
    # trims its oldest units instead of ending with context_length_exceeded (docs/model.md, Duplex context
    # window)
    duplex_window: str = "basic"
    duplex_window_high: int = 8000
    duplex_window_low: int = 6000
    # thinker only: the projection weights, "bf16" (the checkpoint's dtype) or "fp8" (e4m3 per-channel)
    weights: str = "bf16"
    # thinker only: the KV cache, "bf16" (the model's dtype) or "fp8" (e4m3, no scale)
    kv_cache: str = "bf16"
    # thinker only: automatic prefix caching (full KV blocks shared by content hash), on by default
    prefix_caching: bool = True
    # thinker only: rows per engine step (decode rows + prefill chunks)
    max_step_tokens: int = 512
    # thinker only: graphed streaming-Whisper passes for duplex units (off by default)
    whisper_graphs: bool = False
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
class TranscriptionSettings:
    """How ``/v1/audio/transcriptions`` and ``/translations`` cut a file and bound each window's text.

    A window is at most ``window_s`` seconds (cut at a pause) and runs as its own thinker request, at most
    ``max_parallel_windows`` at once; its text is at most ``tokens_per_second`` x its duration +
    ``extra_tokens`` tokens (docs/audio_api.md, "Windows and the token cap", says why these values)."""

    window_s: float = 20.0
    max_parallel_windows: int = 8
    tokens_per_second: float = 7.5
    extra_tokens: int = 8


@dataclass(frozen=True)
class GatewayProfile:
    port: int = 8099
    max_concurrent_requests: int = 16
    # Realtime duplex sessions admitted at once; each holds a persistent thinker sequence.
    max_realtime_sessions: int = 4
    max_body_bytes: int = 64 * 1024 * 1024
    request_timeout_s: float = 600.0
    # A request body that sends nothing for this long is answered 408 and its connection closed, so a
    # client that stalls mid-upload (or trickles bytes to hold a socket) does not keep it open forever.
    body_idle_timeout_s: float = 30.0
    # Chat output when a request names no ``modalities`` (a request's own value always wins); ["text"]
    # as OpenAI, ["text", "audio"] for deployments whose clients expect speech without asking.
    default_modalities: tuple[str, ...] = ("text",)
    # On SIGTERM in-flight chat streams and realtime responses may finish within this many seconds
    # (gateway.shutdown); whatever is still running then ends with an error event / session.closed.
    drain_grace_s: float = 30.0
    media: MediaLimits = field(default_factory=MediaLimits)
    transcription: TranscriptionSettings = field(default_factory=TranscriptionSettings)
    # Registered voices (/v1/audio/voices): one sub-directory per voice holding the clip and the stage
    # features derived from it once. Shared by every gateway replica (a volume); None: registry off.
    voice_dir: str | None = None


@dataclass(frozen=True)
class TLSProfile:
    """TLS between the gateway and every stage (services/common/tls.py). Paths as the processes see them.

    ``cert_file``/``key_file``: the stages' certificate (its SANs must cover every stage address);
    ``ca_file``: the CA the gateway verifies it against, and with ``require_client_cert`` the CA the
    stages require the gateway's ``client_cert_file``/``client_key_file`` to chain to (mutual TLS).
    """

    ca_file: str
    cert_file: str
    key_file: str
    client_cert_file: str | None = None
    client_key_file: str | None = None
    require_client_cert: bool = False


@dataclass(frozen=True)
class DeployProfile:
    name: str
    description: str = ""
    served_model_name: str = DEFAULT_SERVED_MODEL_NAME
    gateway: GatewayProfile = field(default_factory=GatewayProfile)
    stages: Mapping[str, StageProfile] = field(default_factory=dict)
    source: str = ""
    tls: TLSProfile | None = None
    # How stages placed on one GPU share it (services.common.gpu_sharing): "time_slice" or "mps".
    gpu_sharing: str = "time_slice"

    def stage(self, name: str) -> StageProfile:
        return self.stages[name]

    def with_device(self, device: str) -> DeployProfile:
        """Force every replica onto ``device`` (``cpu`` or ``cuda``), keeping replica counts.

        ``cuda`` keeps the profile's explicit GPU indices when it has them; a profile written for CPU
        gets ``cuda:0`` for every replica.
        """
        device = check_device(device, "--device")
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
            elif key in ("gateway", "served_model_name", "description", "tls", "gpu_sharing"):
                current = raw.get(key)
                raw[key] = (
                    _deep_merge(current, value, f"overrides.{key}") if isinstance(current, dict) else value
                )
            else:
                raise ProfileError(
                    f"stage overrides: unknown key {key!r} (expected one of {list(STAGES)} or gateway)"
                )
        return parse_profile(raw, source=self.source + " + overrides")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("source")
        if data["tls"] is None:
            data.pop("tls")
        data["version"] = 1
        data["gateway"]["default_modalities"] = list(data["gateway"]["default_modalities"])
        for name, sp in data["stages"].items():
            sp.pop("name")
            sp["devices"] = list(sp["devices"])
            sp["sampling"] = dict(sp["sampling"])
            if name != "thinker":
                for key in (
                    "hidden_chunk_tokens",
                    "first_hidden_chunk_tokens",
                    "hidden_dtype",
                    "weights",
                    "kv_cache",
                    "kernel_table",
                    "fp8_table",
                    "prefix_caching",
                    "max_step_tokens",
                    "whisper_graphs",
                    *THINKER_WINDOW_KEYS,
                ):
                    sp.pop(key)
            if name != "talker":
                sp.pop("codec")
                sp.pop("steps_per_replay")
            if name == "code2wav":
                sp.pop("sampling")
                sp.pop("kernels")
        return data


def _deep_merge(base: Any, update: Any, where: str) -> Any:
    if not isinstance(update, Mapping):
        return copy.deepcopy(update)
    if not isinstance(base, Mapping):
        raise ProfileError(f"{where}: cannot merge a mapping into {type(base).__name__}")
    merged = dict(base)
    for k, v in update.items():
        merged[k] = (
            _deep_merge(merged[k], v, f"{where}.{k}")
            if isinstance(merged.get(k), Mapping)
            else copy.deepcopy(v)
        )
    return merged


def _stage_profile(name: str, doc: ThinkerDoc | TalkerDoc | Code2WavDoc) -> StageProfile:
    fields = doc.given()
    for key in ("devices", "device", "replicas", "notes", "sampling", "codec"):
        fields.pop(key, None)
    fields["devices"] = doc.placement()
    fields.setdefault("port", DEFAULT_STAGE_PORTS[name])
    sampling = getattr(doc, "sampling", None)
    fields["sampling"] = sampling.given() if sampling is not None else {}
    codec = getattr(doc, "codec", None)
    if codec is not None:
        fields["codec"] = CodecWindows(**codec.given())
    return StageProfile(name=name, **fields)


def parse_profile(raw: object, source: str = "<dict>") -> DeployProfile:
    """Validate a loaded YAML/JSON document (:mod:`services.common.deploy_schema`) and build the profile."""
    doc = validate_document(raw, source)
    gateway = GatewayProfile()
    if doc.gateway is not None:
        gw = doc.gateway.given()
        media = gw.pop("media", None)
        transcription = gw.pop("transcription", None)
        if "default_modalities" in gw:
            gw["default_modalities"] = tuple(dict.fromkeys(gw["default_modalities"]))
        gateway = GatewayProfile(
            **gw,
            media=MediaLimits(**media.given()) if media is not None else MediaLimits(),
            transcription=TranscriptionSettings(**transcription.given())
            if transcription is not None
            else TranscriptionSettings(),
        )
    stages = {name: _stage_profile(name, getattr(doc.stages, name)) for name in STAGES}
    return DeployProfile(
        name=doc.name or Path(source).stem,
        description=(doc.description or "").strip(),
        served_model_name=doc.served_model_name or DEFAULT_SERVED_MODEL_NAME,
        gateway=gateway,
        stages=stages,
        source=source,
        tls=TLSProfile(**doc.tls.given()) if doc.tls is not None else None,
        gpu_sharing=doc.gpu_sharing or "time_slice",
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
    section: dict[str, Any] = data
    return section


def apply_memory_fraction(settings: Mapping[str, Any] | None, device: str) -> None:
    """Cap this process's CUDA caching allocator at the profile's memory share (no-op on CPU)."""
    if not settings or not settings.get("memory_fraction") or not device.startswith("cuda"):
        return
    import torch

    index = int(device.split(":", 1)[1]) if ":" in device else 0
    torch.cuda.set_per_process_memory_fraction(float(settings["memory_fraction"]), index)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.common.deploy_profile", description=__doc__.split("\n")[0]
    )
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
