"""The deploy-profile *document* (what a YAML file may hold) as pydantic v2 models.

:func:`services.common.deploy_profile.parse_profile` validates a loaded document here — types, ranges,
unknown keys and the per-stage rules in one pass — and then builds the resolved, frozen
:class:`~services.common.deploy_profile.DeployProfile`. Every field is optional (``None`` or absent: the
profile's default applies), types are strict (no ``"4"`` for 4, no ``true`` for 1), and
:func:`profile_error` turns the first pydantic error into the :class:`ProfileError` message users have
always seen: ``<file>: stages.thinker.memory_fraction: must be in (0, 1], got 1.5``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    model_validator,
)

STAGES: tuple[str, ...] = ("thinker", "talker", "code2wav")
DTYPES = frozenset({"bfloat16", "float16", "float32"})

T = TypeVar("T")


class ProfileError(ValueError):
    """A deploy profile is malformed; the message names the file and the offending key."""


def check_device(value: object, where: str) -> str:
    """A replica's device (``cpu``, ``cuda`` or ``cuda:N``); ``where`` prefixes the error."""
    message = _device_problem(value)
    if message is not None:
        raise ProfileError(f"{where}: {message}")
    assert isinstance(value, str)
    return value


def _device_problem(value: object) -> str | None:
    if not isinstance(value, str):
        return f"device must be a string like 'cpu', 'cuda' or 'cuda:3', got {value!r}"
    if value in ("cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return None
    return f"device must be 'cpu', 'cuda' or 'cuda:N', got {value!r}"


# ------------------------------------------------------------------------------------------ field rules


def _rule(ok: Callable[[Any], bool], message: str) -> AfterValidator:
    """An after-validator that refuses a value of the right type with ``message`` (``{v}``: the value)."""

    def check(value: T) -> T:
        if not ok(value):
            raise ValueError(message.format(v=value))
        return value

    return AfterValidator(check)


def _device(value: object) -> object:
    message = _device_problem(value)
    if message is not None:
        raise ValueError(message)
    return value


def _refuse(message: str) -> BeforeValidator:
    """A key that exists in the document only on other stages: present here, it is refused with ``message``."""

    def refuse(value: object) -> object:
        raise ValueError(message)

    return BeforeValidator(refuse)


def _sampling(kind: str) -> BeforeValidator:
    """Sampling values keep their own wording (``expected a non-negative integer, got 'x'``)."""

    def check(value: object) -> object:
        if kind == "bool":
            if not isinstance(value, bool):
                raise ValueError("expected a boolean")
            return value
        is_number = isinstance(value, int) or (kind == "float" and isinstance(value, float))
        if isinstance(value, bool) or not is_number or value < 0:  # type: ignore[operator]
            noun = "integer" if kind == "int" else "number"
            raise ValueError(f"expected a non-negative {noun}, got {value!r}")
        return float(value) if kind == "float" else value  # type: ignore[arg-type]

    return BeforeValidator(check)


PositiveInt = Annotated[int, _rule(lambda v: v > 0, "must be positive, got {v}")]
PositiveNumber = Annotated[float, _rule(lambda v: v > 0, "must be positive, got {v}")]
NonNegativeNumber = Annotated[float, _rule(lambda v: v >= 0, "must be >= 0, got {v}")]
Count = Annotated[int, _rule(lambda v: v >= 0, "must be >= 0, got {v}")]
Device = Annotated[str, BeforeValidator(_device)]
DType = Annotated[str, _rule(lambda v: v in DTYPES, f"expected one of {sorted(DTYPES)}, got {{v!r}}")]
Port = Annotated[
    int, _rule(lambda v: 0 < v < 65536 - 1000, "{v} is not a usable port (metrics use port + 1000)")
]
GatewayPort = Annotated[int, _rule(lambda v: 0 < v < 65536, "{v} is not a port number (1 to 65535)")]


def port_arg(text: str, allow_zero: bool = False) -> int:
    """A ``--port``-style command-line value: a TCP port number (0 too with ``allow_zero``: "pick one" or
    "off"), refused by argparse with a one-line reason rather than failing later at bind time."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    low = 0 if allow_zero else 1
    if not low <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number ({low} to 65535)")
    return value


def port_or_zero_arg(text: str) -> int:
    """:func:`port_arg` that also takes 0."""
    return port_arg(text, allow_zero=True)


Fraction = Annotated[float, _rule(lambda v: 0 < v <= 1, "must be in (0, 1], got {v}")]
Frames = Annotated[int, _rule(lambda v: v >= 1, "out of range ({v})")]
ContextFrames = Annotated[int, _rule(lambda v: v >= 0, "out of range ({v})")]
SamplingInt = Annotated[int, _sampling("int")]
SamplingFloat = Annotated[float, _sampling("float")]
SamplingBool = Annotated[bool, _sampling("bool")]
HiddenOnlyThinker = Annotated[None, _refuse("only the thinker exports hidden states")]
CodecOnlyTalker = Annotated[None, _refuse("codec windows are a talker setting")]
NoSampling = Annotated[None, _refuse("code2wav has no sampling parameters")]
WindowOnlyThinker = Annotated[None, _refuse("the duplex context window is a thinker setting")]
PrefixOnlyThinker = Annotated[None, _refuse("prefix caching is a thinker setting")]
WhisperGraphsOnlyThinker = Annotated[None, _refuse("the streaming-Whisper graphs are a thinker setting")]
WindowMode = Annotated[str, _rule(lambda v: v in ("off", "basic"), "expected 'off' or 'basic', got {v!r}")]
WeightFormat = Annotated[str, _rule(lambda v: v in ("bf16", "fp8"), "expected 'bf16' or 'fp8', got {v!r}")]
WeightsOnlyThinker = Annotated[None, _refuse("fp8 weights are a thinker setting")]
KvCacheOnlyThinker = Annotated[None, _refuse("the KV cache format is a thinker setting")]
KERNEL_BACKENDS = ("auto", "torch", "triton")
Kernels = Annotated[
    str, _rule(lambda v: v in KERNEL_BACKENDS, f"expected one of {list(KERNEL_BACKENDS)}, got {{v!r}}")
]
Milliseconds = Annotated[float, _rule(lambda v: v >= 0, "must be >= 0, got {v}")]
# An audio window of the thinker's encoder: its position table spans 30 s.
WindowSeconds = Annotated[float, _rule(lambda v: 1 <= v <= 30, "must be in [1, 30] s, got {v}")]


class _Doc(BaseModel):
    """A mapping of the document: strict types, ``null`` means absent, unknown keys refused by name."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    _unknown_noun: ClassVar[str] = "key"

    @model_validator(mode="before")
    @classmethod
    def _mapping(cls, data: object) -> dict[str, object]:
        if not isinstance(data, Mapping):
            raise ValueError(f"expected a mapping, got {type(data).__name__}")
        for key in data:
            if key not in cls.model_fields:
                raise ValueError(f"unknown {cls._unknown_noun} {key!r} (allowed: {sorted(cls.model_fields)})")
        return {k: v for k, v in data.items() if v is not None}

    def given(self) -> dict[str, Any]:
        """The keys the document set (the profile's defaults fill the rest)."""
        return {k: getattr(self, k) for k in self.model_fields_set}


class _SamplingDoc(_Doc):
    """Keys both the thinker's ``SamplingParams`` and the talker's ``TalkerSampling`` have."""

    _unknown_noun: ClassVar[str] = "sampling key"
    temperature: SamplingFloat | None = None
    top_p: SamplingFloat | None = None
    top_k: SamplingInt | None = None
    repetition_penalty: SamplingFloat | None = None
    seed: SamplingInt | None = None


class ThinkerSamplingDoc(_SamplingDoc):
    max_tokens: SamplingInt | None = None
    min_tokens: SamplingInt | None = None
    ignore_eos: SamplingBool | None = None


class TalkerSamplingDoc(_SamplingDoc):
    min_new_frames: SamplingInt | None = None
    max_new_frames: SamplingInt | None = None
    fixed_frames: SamplingInt | None = None


class CodecDoc(_Doc):
    window_frames: Frames | None = None
    left_context_frames: ContextFrames | None = None
    first_window_frames: Frames | None = None


class _StageDoc(_Doc):
    """Keys every stage takes; ``devices`` (one per replica) or the ``device`` + ``replicas`` shorthand."""

    devices: Annotated[list[Device], _rule(bool, "at least one replica is needed")] | None = None
    device: Device | None = None
    replicas: PositiveInt | None = None
    port: Port | None = None
    memory_fraction: Fraction | None = None
    max_num_seqs: PositiveInt | None = None
    max_model_len: PositiveInt | None = None
    dtype: DType | None = None
    # An engine step slower than this many ms is logged with its phases (services/common/slow_steps.py); 0: off.
    slow_step_ms: Milliseconds | None = None
    # Under MPS, the scheduling priority of the stage's GPU work against the other stages' (CUDA's
    # CUDA_MPS_CLIENT_PRIORITY; services/common/gpu_sharing.py). Ignored without MPS.
    gpu_priority: Literal["normal", "below_normal"] | None = None
    notes: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_placement(cls, data: object) -> object:
        if (
            isinstance(data, Mapping)
            and data.get("devices") is not None
            and (data.get("device") is not None or data.get("replicas") is not None)
        ):
            raise ValueError("give either 'devices' (one per replica) or 'device' + 'replicas', not both")
        return data

    def placement(self) -> tuple[str, ...]:
        if self.devices is not None:
            return tuple(self.devices)
        return tuple(self.device or "cpu" for _ in range(self.replicas or 1))


class ThinkerDoc(_StageDoc):
    sampling: ThinkerSamplingDoc | None = None
    hidden_chunk_tokens: PositiveInt | None = None
    first_hidden_chunk_tokens: PositiveInt | None = None
    hidden_dtype: DType | None = None
    # The duplex sliding context window (services/thinker/duplex_window.py, docs/model.md, Duplex context
    # window).
    duplex_window: WindowMode | None = None
    duplex_window_high: PositiveInt | None = None
    duplex_window_low: PositiveInt | None = None
    # The projection weights: bf16 (the checkpoint's) or fp8 (e4m3, per-channel scales; services/thinker/fp8_weights.py).
    weights: WeightFormat | None = None
    # The KV cache: bf16 (the model's dtype) or fp8 (e4m3, no scale: half the bytes a decode step reads
    # and twice the tokens per GiB; services/thinker/kv_cache.py).
    kv_cache: WeightFormat | None = None
    # Decode kernels (services/common/kernels): auto = Triton on CUDA, torch elsewhere.
    kernels: Kernels | None = None
    # A `bench.thinker.skinny --json-out` table of skinny-GEMM configs for a GPU the built-in one was not
    # measured on (services/common/kernels/skinny.py); a path as the thinker process sees it.
    kernel_table: str | None = None
    # A `bench.thinker.fp8 --json-out` table of fp8 GEMM configs (weights: fp8), for a GPU the built-in
    # table was not measured on or for the packed steps' 64- and 128-row buckets it leaves to the default
    # (services/common/kernels/fp8_gemm.py); a path as the thinker process sees it.
    fp8_table: str | None = None
    # Automatic prefix caching of full KV blocks (on unless a profile says false).
    prefix_caching: StrictBool | None = None
    # Rows one engine step may hold: every decoding sequence's token plus prefill chunks in the rest
    # (services/thinker/scheduler.py). At most 128, every step fits a captured row graph; more lets a long
    # prompt prefill in fewer, eager steps that the decoding sequences wait on.
    max_step_tokens: PositiveInt | None = None
    # Duplex encode passes replay CUDA graphs of the streaming-Whisper layers (services/thinker/whisper_graph.py);
    # off unless a profile says true, until a GPU run has measured them against the eager pass.
    whisper_graphs: StrictBool | None = None
    codec: CodecOnlyTalker = None

    @model_validator(mode="after")
    def _window_marks(self) -> ThinkerDoc:
        if self.duplex_window == "off":
            return self
        low, high = self.duplex_window_low or 6000, self.duplex_window_high or 8000
        if not low < high:
            raise ValueError(f"duplex window: need duplex_window_low ({low}) < duplex_window_high ({high})")
        if self.max_model_len is not None and high > self.max_model_len:
            raise ValueError(f"duplex_window_high ({high}) exceeds max_model_len ({self.max_model_len})")
        return self

    @model_validator(mode="after")
    def _step_holds_every_decode(self) -> ThinkerDoc:
        seqs = self.max_num_seqs or 4
        if self.max_step_tokens is not None and self.max_step_tokens < seqs:
            raise ValueError(
                f"max_step_tokens ({self.max_step_tokens}) is below max_num_seqs ({seqs}): a step must "
                "hold one decode row of every running sequence"
            )
        return self


class _NoHiddenDoc(_StageDoc):
    """A stage after the thinker: the hidden-state keys are named, to be refused with a reason."""

    hidden_chunk_tokens: HiddenOnlyThinker = None
    first_hidden_chunk_tokens: HiddenOnlyThinker = None
    hidden_dtype: HiddenOnlyThinker = None
    duplex_window: WindowOnlyThinker = None
    duplex_window_high: WindowOnlyThinker = None
    duplex_window_low: WindowOnlyThinker = None
    weights: WeightsOnlyThinker = None
    kv_cache: KvCacheOnlyThinker = None
    prefix_caching: PrefixOnlyThinker = None
    whisper_graphs: WhisperGraphsOnlyThinker = None


class TalkerDoc(_NoHiddenDoc):
    sampling: TalkerSamplingDoc | None = None
    codec: CodecDoc | None = None
    # Fused decode kernels (services/talker/fused_decode.py): auto = Triton on CUDA, torch elsewhere.
    kernels: Kernels | None = None
    # Decode steps per CUDA-graph replay (services/talker/multistep.py); default 4 with graphs, 1 without.
    steps_per_replay: PositiveInt | None = None


class Code2WavDoc(_NoHiddenDoc):
    sampling: NoSampling = None
    codec: CodecOnlyTalker = None


class StagesDoc(_Doc):
    thinker: ThinkerDoc = ThinkerDoc()
    talker: TalkerDoc = TalkerDoc()
    code2wav: Code2WavDoc = Code2WavDoc()


class MediaDoc(_Doc):
    video_fps: PositiveNumber | None = None
    video_max_frames: PositiveInt | None = None
    max_images: Count | None = None
    max_audios: Count | None = None
    max_videos: Count | None = None
    max_audio_seconds: PositiveNumber | None = None
    max_video_seconds: PositiveNumber | None = None
    max_image_pixels: PositiveInt | None = None
    max_media_bytes: PositiveInt | None = None


class TranscriptionDoc(_Doc):
    window_s: WindowSeconds | None = None
    max_parallel_windows: PositiveInt | None = None
    tokens_per_second: PositiveNumber | None = None
    extra_tokens: Count | None = None


class GatewayDoc(_Doc):
    port: GatewayPort | None = None
    max_concurrent_requests: PositiveInt | None = None
    max_realtime_sessions: PositiveInt | None = None
    max_body_bytes: PositiveInt | None = None
    request_timeout_s: PositiveNumber | None = None
    body_idle_timeout_s: PositiveNumber | None = None
    # Output of a chat request that names no ``modalities`` (OpenAI's default: text only).
    default_modalities: list[Literal["text", "audio"]] | None = Field(default=None, min_length=1)
    drain_grace_s: NonNegativeNumber | None = None
    media: MediaDoc | None = None
    transcription: TranscriptionDoc | None = None
    voice_dir: Annotated[str, _rule(bool, "must not be empty")] | None = None


class TLSDoc(_Doc):
    """TLS between the gateway and the stages (services/common/tls.py); file paths as the processes see them."""

    ca_file: str
    cert_file: str
    key_file: str
    client_cert_file: str | None = None
    client_key_file: str | None = None
    require_client_cert: bool | None = None

    @model_validator(mode="after")
    def _client_pair(self) -> TLSDoc:
        if bool(self.client_cert_file) != bool(self.client_key_file):
            raise ValueError("client_cert_file and client_key_file go together")
        if self.require_client_cert and not self.client_cert_file:
            raise ValueError("require_client_cert needs the gateway's client_cert_file and client_key_file")
        return self


class ProfileDoc(_Doc):
    version: int | None = None
    name: str | None = None
    description: str | None = None
    served_model_name: str | None = None
    gpu_sharing: Literal["time_slice", "mps"] | None = None
    gateway: GatewayDoc | None = None
    tls: TLSDoc | None = None
    stages: StagesDoc

    @model_validator(mode="before")
    @classmethod
    def _three_stages(cls, data: object) -> object:
        """The stage set is checked before the stages themselves, with the messages it always had."""
        if not isinstance(data, Mapping):
            return data
        version = data.get("version")
        if isinstance(version, int) and not isinstance(version, bool) and version != 1:
            raise ValueError(f"unsupported profile version {version} (this build reads 1)")
        stages = data.get("stages")
        if not stages:
            raise ValueError("'stages' is required (thinker, talker, code2wav)")
        if isinstance(stages, Mapping):
            unknown = set(stages) - set(STAGES)
            if unknown:
                raise ValueError(f"unknown stages {sorted(unknown)} (expected {list(STAGES)})")
            missing = [s for s in STAGES if s not in stages]
            if missing:
                raise ValueError(f"stages missing: {missing}")
        return data


# ------------------------------------------------------------------------------------------ errors

# How the hand-written checks named the expected type; kept so the messages stay what users know.
_EXPECTED = {
    "int_type": int,
    "float_type": (int, float),
    "string_type": str,
    "list_type": list,
    "dict_type": dict,
    "model_type": dict,
    "bool_type": bool,
}


def _where(source: str, loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return f"{source}: {path}" if path else source


def profile_error(exc: ValidationError, source: str) -> ProfileError:
    """The first error of a validation, worded as the profile's own checks word it."""
    err = exc.errors(include_url=False)[0]
    where = _where(source, err["loc"])
    ctx = err.get("ctx") or {}
    value = err.get("input")
    if err["type"] == "value_error" and "error" in ctx:
        return ProfileError(f"{where}: {ctx['error']}")
    expected = _EXPECTED.get(err["type"])
    if expected is not None:
        got = "a boolean" if isinstance(value, bool) else f"{type(value).__name__} {value!r}"
        return ProfileError(f"{where}: expected {expected}, got {got}")
    if err["type"] == "missing":
        return ProfileError(f"{where}: is required")
    return ProfileError(f"{where}: {err['msg']}")


def validate_document(raw: object, source: str) -> ProfileDoc:
    """Validate a loaded YAML/JSON document; a malformed one raises :class:`ProfileError`."""
    try:
        return ProfileDoc.model_validate(raw)
    except ValidationError as exc:
        raise profile_error(exc, source) from None
