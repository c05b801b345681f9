"""docs/config.md, generated: every deploy-profile key with its type, range, default and CLI override, and
the few environment variables the processes read.

The profile (:mod:`services.common.deploy_schema`, :mod:`services.common.deploy_profile`) is the one
configuration of every behaviour; this module renders it as one table so that an operator finds every
knob in one place, and ``tests/test_config_table.py`` fails when the committed docs/config.md is stale
or when the code reads an environment variable not listed in :data:`ENVIRONMENT`.

    python -m services.common.config_table            # print the document
    python -m services.common.config_table --write    # rewrite docs/config.md
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from services.common import deploy_schema as ds
from services.common.deploy_profile import (
    DEFAULT_STAGE_PORTS,
    CodecWindows,
    DeployProfile,
    GatewayProfile,
    MediaLimits,
    StageProfile,
    TLSProfile,
    TranscriptionSettings,
)
from services.common.stage_settings import MEMORY_FRACTION_FLAG, PROFILE_FLAG_DESTS

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"

# The environment variables a process of this project reads, and why each is one (every other setting is
# a profile key or a flag). tests/test_config_table.py checks the code reads no other.
ENVIRONMENT: dict[str, str] = {
    "MINICPMO_STAGE_SETTINGS": "internal: the launcher (and the image entrypoint) hands a stage process its "
    "resolved profile section as JSON; never set by hand",
    "MINICPMO_API_KEY": "the gateway's API key (a secret: the environment keeps it off command lines); the "
    "example clients send it",
    "CUDA_VISIBLE_DEVICES": "CUDA's own placement variable: the launcher sets it per stage replica from the "
    "profile's `devices`",
    "CUDA_MPS_PIPE_DIRECTORY": "CUDA MPS's own variable: with `gpu_sharing: mps` the launcher points the "
    "stages at its private MPS daemon",
    "TRITON_INTERPRET": "Triton's own variable: `1` runs the Triton kernels on the CPU (tests)",
    "XDG_CACHE_HOME": "the XDG base directory: `minicpmo-serve` caches the tiny checkpoint in "
    "`$XDG_CACHE_HOME/minicpmo`",
}
# Container images only: docker/entrypoint.py and the Dockerfile's commands read these (compose and the
# Helm chart set them); the Python services themselves take flags.
IMAGE_ENVIRONMENT: dict[str, str] = {
    "MINICPMO_DEPLOY_PROFILE": "the profile file or bundled name the entrypoint resolves",
    "MINICPMO_STAGE": "which stage the container runs",
    "MINICPMO_CHECKPOINT, MINICPMO_DEVICE, MINICPMO_GRPC_PORT, MINICPMO_HTTP_PORT": "the default command's "
    "checkpoint, device and ports",
    "MINICPMO_TLS_CERT, MINICPMO_TLS_KEY, MINICPMO_TLS_CLIENT_CA, MINICPMO_TLS_CA": "a stage's TLS files "
    "(also read by the gRPC health probe)",
    "MINICPMO_STAGE_TLS_CA, MINICPMO_STAGE_TLS_CERT, MINICPMO_STAGE_TLS_KEY": "the gateway's TLS files "
    "towards the stages",
}

_RANGES: list[tuple[Any, str]] = [
    (ds.PositiveInt, "integer ≥ 1"),
    (ds.PositiveNumber, "number > 0"),
    (ds.NonNegativeNumber, "number ≥ 0"),
    (ds.Count, "integer ≥ 0"),
    (ds.Device, "`cpu`, `cuda` or `cuda:N`"),
    (ds.DType, "`bfloat16`, `float16`, `float32`"),
    (ds.Port, "1 … 64534 (the metrics port is port + 1000)"),
    (ds.GatewayPort, "1 … 65535"),
    (ds.Fraction, "(0, 1]"),
    (ds.Frames, "integer ≥ 1"),
    (ds.ContextFrames, "integer ≥ 0"),
    (ds.SamplingInt, "integer ≥ 0"),
    (ds.SamplingFloat, "number ≥ 0"),
    (ds.SamplingBool, "boolean"),
    (ds.WindowMode, "`off`, `basic`"),
    (ds.WeightFormat, "`bf16`, `fp8`"),
    (ds.Kernels, "`auto`, `torch`, `triton`"),
    (ds.Milliseconds, "number ≥ 0 (0: off)"),
    (ds.WindowSeconds, "number in [1, 30]"),
    (bool, "boolean"),
    (int, "integer"),
    (str, "string"),
]

# Flags of `minicpmo-serve` (launcher) and `python -m gateway` that override gateway keys.
_GATEWAY_FLAGS = {
    "port": "`minicpmo-serve --port`, `python -m gateway --port`",
    "max_concurrent_requests": "`--max-concurrent-requests` (both)",
    "max_realtime_sessions": "`--max-realtime-sessions` (both)",
    "max_body_bytes": "`python -m gateway --max-body-bytes`",
    "request_timeout_s": "`python -m gateway --request-timeout`",
    "voice_dir": "`python -m gateway --voice-dir`",
    "drain_grace_s": "`--drain-grace` (both)",
}
_TOP_FLAGS = {"served_model_name": "`--served-model-name` (both)"}
# Each stage's command line, named in the table's "set by" column (text only: nothing is imported).
_STAGE_CLI = {stage: f"python -m services.{stage}" for stage in ("thinker", "talker", "code2wav")}


def _range(annotation: Any) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = args[0] if len(args) == 1 else annotation
    for alias, text in _RANGES:
        if annotation == alias:
            return text
    if typing.get_origin(annotation) is typing.Annotated:  # e.g. a list with a rule of its own
        return _range(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) is typing.Literal:
        return ", ".join(f"`{v}`" for v in typing.get_args(annotation))
    if typing.get_origin(annotation) is list:
        return f"list of {_range(typing.get_args(annotation)[0])}"
    raise ValueError(f"no range text for {annotation!r}: add it to _RANGES")


def _refused(annotation: Any) -> bool:
    """A key named only to be refused on this stage (``HiddenOnlyThinker`` and its kind)."""
    return typing.get_args(annotation)[:1] == (type(None),) or annotation is type(None)


def _fmt(value: Any) -> str:
    if value is None:
        return "unset"
    if value == "":
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple | list):
        return "`[" + ", ".join(str(v) for v in value) + "]`"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1e6:
        return f"`{int(value)}`"
    return f"`{value}`"


def _default_of(obj: Any, key: str) -> Any:
    """The resolved profile's value of ``key`` when the document leaves it out (``obj``: a default
    instance of the resolved dataclass)."""
    return getattr(obj, key, None) if dataclasses.is_dataclass(obj) else None


def _rows(model: type[BaseModel], prefix: str, defaults: Any, flags: dict[str, str]) -> list[list[str]]:
    """One row per key of ``model`` (nested sections and keys refused on it left out); ``defaults``: a
    resolved dataclass instance, a text for every row, or None (unset)."""
    rows: list[list[str]] = []
    for key, field in model.model_fields.items():
        annotation = field.annotation
        if _refused(annotation):
            continue
        candidates = [annotation, *typing.get_args(annotation)]
        if any(isinstance(a, type) and issubclass(a, BaseModel) for a in candidates):
            continue  # a nested section: its own table
        if field.is_required():
            shown = "required"
        elif defaults is None:
            shown = "unset"
        elif isinstance(defaults, str):
            shown = defaults
        else:
            shown = _fmt(_default_of(defaults, key))
        rows.append([f"`{prefix}{key}`", _range(annotation), shown, flags.get(key, "")])
    return rows


def _stage_rows(stage: str, doc: type[BaseModel]) -> list[list[str]]:
    base = StageProfile(name=stage, port=DEFAULT_STAGE_PORTS[stage])
    cli = _STAGE_CLI[stage]
    flags = {key: f"`{cli} --{dest.replace('_', '-')}`" for key, dest in PROFILE_FLAG_DESTS[stage].items()}
    flags["memory_fraction"] = f"`{cli} {MEMORY_FRACTION_FLAG}`"
    flags["port"] = f"`{cli} --port` (`minicpmo-serve --stage-ports auto`)"
    flags["devices"] = "`minicpmo-serve --device cpu` or `cuda` (all stages)"
    rows = _rows(doc, f"stages.{stage}.", base, flags)
    for row in rows:
        if row[0] in (f"`stages.{stage}.device`", f"`stages.{stage}.replicas`"):
            row[2] = "shorthand for `devices`"
        if row[0] == f"`stages.{stage}.notes`":
            row[2] = "free text"
        if row[0] == f"`stages.{stage}.steps_per_replay`":
            row[2] = "4 with CUDA graphs, 1 without"
    return rows


def _table(rows: list[list[str]]) -> list[str]:
    out = ["| key | type / range | default | CLI override |", "|---|---|---|---|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def render() -> str:
    """The whole of docs/config.md."""
    top = DeployProfile(name="the file's name")
    lines = [
        "# Configuration",
        "",
        "<!-- generated by `python -m services.common.config_table --write`; tests/test_config_table.py "
        "checks it -->",
        "",
        "One deploy profile (`configs/deploy/*.yaml`, validated by `services/common/deploy_schema.py`)",
        "configures every behaviour; a flag overrides a key where an operator needs one, and",
        '`minicpmo-serve --stage-overrides \'{"thinker": {"kernels": "torch"}}\'` overrides any key. Unknown',
        "keys, wrong types and values out of range stop the process at start with the key's name. Sampling",
        "keys left unset take the model's defaults (docs/model.md).",
        "",
        "## Top level",
        "",
        *_table(_rows(ds.ProfileDoc, "", top, _TOP_FLAGS)),
        "",
        "## Gateway",
        "",
        *_table(_rows(ds.GatewayDoc, "gateway.", GatewayProfile(), _GATEWAY_FLAGS)),
        "",
        "### Media limits",
        "",
        *_table(_rows(ds.MediaDoc, "gateway.media.", MediaLimits(), {})),
        "",
        "### Transcription windows (`/v1/audio/transcriptions`, `/translations`; docs/audio_api.md)",
        "",
        *_table(_rows(ds.TranscriptionDoc, "gateway.transcription.", TranscriptionSettings(), {})),
        "",
        "## TLS between the gateway and the stages (optional section)",
        "",
        *_table(_rows(ds.TLSDoc, "tls.", TLSProfile("", "", ""), {})),
        "",
    ]
    for stage, doc in (("thinker", ds.ThinkerDoc), ("talker", ds.TalkerDoc), ("code2wav", ds.Code2WavDoc)):
        lines += [f"## Stage `{stage}`", "", *_table(_stage_rows(stage, doc)), ""]
    lines += [
        "### Sampling defaults (`stages.thinker.sampling`, `stages.talker.sampling`)",
        "",
        *_table(_rows(ds.ThinkerSamplingDoc, "stages.thinker.sampling.", "the model's", {})),
        "",
        *_table(_rows(ds.TalkerSamplingDoc, "stages.talker.sampling.", "the model's", {})),
        "",
        "### Codec windows (`stages.talker.codec`)",
        "",
        *_table(_rows(ds.CodecDoc, "stages.talker.codec.", CodecWindows(), {})),
        "",
        "## Environment variables",
        "",
        "Only what the ecosystem expects to find in the environment; no behaviour switch is one.",
        "",
        "| variable | what |",
        "|---|---|",
        *[f"| `{name}` | {what} |" for name, what in ENVIRONMENT.items()],
        "",
        "Container images (`Dockerfile`, `docker/entrypoint.py`, `docker/grpc_health_probe.py`; set by",
        "compose and the Helm chart) also read:",
        "",
        "| variable | what |",
        "|---|---|",
        *[f"| `{name}` | {what} |" for name, what in IMAGE_ENVIRONMENT.items()],
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = render()
    if args == ["--write"]:
        changed = not DOC.is_file() or DOC.read_text(encoding="utf-8") != text
        if changed:
            DOC.write_text(text, encoding="utf-8")
        print(f"{DOC} {'updated' if changed else 'already current'}")
        return 0
    if args:
        print("usage: python -m services.common.config_table [--write]", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
