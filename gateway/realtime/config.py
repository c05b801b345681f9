"""Session configuration (docs/protocol.md, Realtime session object): parse the ``session`` object, validate
it, render it back.

Validation order on open and on update: audio formats, then turn detection, then the MiniCPM-specific
checks (reference audio, ``extra_body``). Turn-detection faults surface as ``invalid_session_config`` on
the opening update and as ``unsupported_turn_detection`` on later ones, like the reference server; the
accepted ``server_vad`` object is echoed back with its defaults filled in.
"""

from __future__ import annotations

import base64
import binascii
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.realtime.audio import (
    OUTPUT_FORMATS,
    UNIT_RATE,
    canonical_input_format,
    default_rate_for,
    resample,
    validate_rate,
)
from gateway.realtime.errors import RealtimeError
from gateway.realtime.tools import ToolSet, parse_tools
from gateway.realtime.vad import normalize_server_vad, silero_available
from gateway.validation_types import FINITE32, PositiveUInt32, Temperature, UInt32
from services.common.audio import AUDIO_DECODE_ERRORS, read_audio

DEFAULT_MODEL = "openbmb/MiniCPM-o-4_5"
DEFAULT_INSTRUCTIONS = "Streaming Omni Conversation."
OVERLAP_POLICIES = ("listen_only", "barge_in_on_speech")
PLAYBACK_POLICIES = ("ack_only", "commit_all_on_done")
# Keys of extra_body that the server owns at runtime; a client may not set them.
SERVER_OWNED_EXTRA_KEYS = frozenset(
    {"session_id", "request_id", "epoch", "unit_seq", "turn_id", "stream_mode"}
)
_MAX_REF_AUDIO_S = 30.0
IdleTimeout = Annotated[float, Field(gt=0.0, le=86_400.0), FINITE32]


class _SessionNumbers(BaseModel):
    """The numeric knobs of ``session.update`` (and their ``extra_body`` ones): finite and in range.

    The field types are the chat body's (gateway/validation_types.py), so a temperature or a token
    budget is held to the same finite range on both APIs. Only these fields are validated by the model (the rest of the session object has ordered,
    mode-dependent rules below); a bad value is ``invalid_session_config`` naming the field.
    """

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=False)

    temperature: Temperature | None = None
    idle_timeout_s: IdleTimeout | None = None
    max_response_output_tokens: PositiveUInt32 | None = None


class _ExtraNumbers(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    force_listen_count: UInt32 | None = None
    max_response_units: PositiveUInt32 | None = None


def _checked_numbers(model: type[BaseModel], values: dict[str, Any], prefix: str) -> BaseModel:
    """``values`` through ``model``; the first error becomes ``invalid_session_config`` naming its field."""
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        first = exc.errors()[0]
        field_name = ".".join(str(p) for p in first.get("loc", ()))
        param = f"{prefix}{field_name}"
        raise RealtimeError(
            "invalid_session_config", f"{param}: {first.get('msg', 'invalid value')}", param=param
        ) from None


@dataclass
class SessionConfig:
    model: str = DEFAULT_MODEL
    modalities: list[str] = field(default_factory=lambda: ["text", "audio"])
    instructions: str = ""
    voice: str | None = None
    ref_audio_uri: str | None = None
    ref_audio: np.ndarray | None = None  # mono float32 at 16 kHz, trimmed to 100 ms multiples
    voice_prompt: Any = None  # a registered voice's stored code2wav features (code2wav_pb2.VoicePrompt)
    thinker_voice: Any = None  # ... and its stored thinker rows (thinker_pb2.VoiceEmbedding)
    input_format: str = "pcm16"
    input_rate: int = UNIT_RATE
    output_format: str = "pcm16"
    turn_detection: dict[str, Any] | None = None
    temperature: float | None = None
    max_response_output_tokens: int | None = None
    idle_timeout_s: float = 300.0
    overlap_policy: str = "listen_only"
    playback_commit_policy: str = "ack_only"
    auto_response: bool = False
    force_listen_count: int = 0
    initial_user_text: str | None = None
    max_response_units: int | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] | None = None
    tools: ToolSet = field(
        default_factory=ToolSet
    )  # function tools and tool_choice (gateway/realtime/tools.py)

    @property
    def wants_audio(self) -> bool:
        return "audio" in self.modalities


def _get(obj: dict[str, Any], *path: str) -> Any:
    cur: Any = obj
    for key in path:
        if not isinstance(cur, dict) or key not in cur:
            return None
        cur = cur[key]
    return cur


def _format_and_rate(spec: Any, param: str) -> tuple[str | None, int | None]:
    """``"pcm16"`` or ``{"type": "audio/pcm", "rate": 24000}`` → (canonical format, rate or None)."""
    if spec is None:
        return None, None
    if isinstance(spec, str):
        try:
            return canonical_input_format(spec), None
        except RealtimeError as exc:
            exc.param = param
            raise
    if isinstance(spec, dict):
        fmt = spec.get("type") or spec.get("format") or "pcm16"
        rate = spec.get("rate")
        try:
            canon = canonical_input_format(fmt)
        except RealtimeError as exc:
            exc.param = param
            raise
        return canon, (validate_rate(rate, f"{param}.rate") if rate is not None else None)
    raise RealtimeError("unsupported_audio_format", f"{param} must be a string or an object", param=param)


def _output_format(spec: Any) -> str | None:
    if spec is None:
        return None
    name = spec.get("type") if isinstance(spec, dict) else spec
    key = str(name).lower()
    key = {
        "audio/pcm": "pcm16",
        "pcm": "pcm16",
        "audio/wav": "wav",
        "audio/pcmu": "g711_ulaw",
        "audio/pcma": "g711_alaw",
    }.get(key, key)
    if key not in OUTPUT_FORMATS:
        raise RealtimeError(
            "unsupported_audio_format",
            f"unsupported output audio format {name!r}",
            param="output_audio_format",
        )
    return key


_REF_AUDIO_ERRORS: tuple[type[Exception], ...] = (binascii.Error, *AUDIO_DECODE_ERRORS)  # bad base64 or audio


def decode_ref_audio(uri: object) -> np.ndarray:
    """A ``data:audio/...;base64`` URI (or bare base64 WAV) → 16 kHz mono float32 trimmed to 100 ms."""
    if not isinstance(uri, str) or not uri:
        raise RealtimeError(
            "bad_ref_audio", "ref_audio must be a data: URI with base64 audio", param="ref_audio"
        )
    payload = uri
    if uri.startswith("data:"):
        if ";base64," not in uri:
            raise RealtimeError("bad_ref_audio", "ref_audio data URI must be base64", param="ref_audio")
        payload = uri.split(";base64,", 1)[1]
    elif uri.startswith(("http://", "https://", "file:", "/")):
        raise RealtimeError(
            "unsupported_ref_audio_path", "ref_audio must be inline (data: URI)", param="ref_audio"
        )
    try:
        mono, rate = read_audio(base64.b64decode(payload, validate=True))
    except _REF_AUDIO_ERRORS as exc:
        raise RealtimeError(
            "bad_ref_audio", f"ref_audio could not be decoded: {exc}", param="ref_audio"
        ) from exc
    if mono.size == 0 or mono.size / rate > _MAX_REF_AUDIO_S:
        raise RealtimeError(
            "bad_ref_audio", f"ref_audio must be 0.1–{_MAX_REF_AUDIO_S:.0f} s", param="ref_audio"
        )
    x = resample(mono, rate, UNIT_RATE)
    keep = (x.size // (UNIT_RATE // 10)) * (UNIT_RATE // 10)
    if keep == 0:
        raise RealtimeError("bad_ref_audio", "ref_audio is shorter than 100 ms", param="ref_audio")
    return x[:keep]


def _validate_turn_detection(td: Any, overlap_policy: str, opening: bool) -> dict[str, Any] | None:
    """``null`` (model-owned turn taking) or ``server_vad`` (gateway VAD, gateway/realtime/vad.py).

    Each mode is tied to its overlap policy: server VAD speech always interrupts a running response, so it
    needs ``barge_in_on_speech``; model-owned turn taking needs ``listen_only``.
    """
    code = "invalid_session_config" if opening else "unsupported_turn_detection"
    if td is None:
        if overlap_policy != "listen_only":
            raise RealtimeError(
                code, "turn_detection null requires overlap_policy listen_only", param="turn_detection"
            )
        return None
    kind = td.get("type") if isinstance(td, dict) else td
    if not isinstance(td, dict) or kind != "server_vad":
        raise RealtimeError(
            code, f"turn_detection {kind!r} is not supported; use null or server_vad", param="turn_detection"
        )
    try:
        normalized = normalize_server_vad(td)
    except ValueError as exc:
        raise RealtimeError(code, str(exc), param="turn_detection") from None
    if overlap_policy != "barge_in_on_speech":
        raise RealtimeError(
            code,
            "turn_detection server_vad requires overlap_policy barge_in_on_speech",
            param="turn_detection",
        )
    if normalized["detector"] == "silero" and not silero_available():
        raise RealtimeError(
            "server_vad_unavailable",
            "the Silero VAD model is not installed on this server; name turn_detection.detector 'energy'",
            param="turn_detection",
        )
    return normalized


def parse_session(
    obj: object,
    *,
    current: SessionConfig | None = None,
    audio_started: bool = False,
    voices: Callable[[str], Any] | None = None,
) -> SessionConfig:
    """Build a config from a ``session`` object; with ``current``, apply it as a live update.

    Any malformed value is a typed error (``invalid_session_config`` for a wrongly typed field), never
    an exception that could take the socket down.
    """
    try:
        return _parse_session(obj, current=current, audio_started=audio_started, voices=voices)
    except (TypeError, ValueError, AttributeError) as exc:
        raise RealtimeError("invalid_session_config", f"malformed session field: {exc}") from exc


def _parse_session(
    obj: Any,
    *,
    current: SessionConfig | None,
    audio_started: bool,
    voices: Callable[[str], Any] | None = None,
) -> SessionConfig:
    """Apply the four groups of fields in order: the first group with a bad field names the error."""
    if obj is None:
        obj = {}
    if not isinstance(obj, dict):
        raise RealtimeError("bad_event", "session must be an object", param="session")
    opening = current is None
    cfg = copy.deepcopy(current) if current is not None else SessionConfig()

    _apply_audio_formats(cfg, obj, opening)
    _apply_turn_taking(cfg, obj, opening)
    extra = obj.get("extra_body") or {}
    if not isinstance(extra, dict):
        raise RealtimeError("bad_event", "extra_body must be an object", param="extra_body")
    _apply_fixed_at_open(cfg, obj, extra, opening, audio_started)
    _apply_registered_voice(cfg, obj, extra, voices)
    _apply_knobs(cfg, obj, extra, opening)
    cfg.tools = parse_tools(obj, "session", cfg.tools)  # 5. function tools, validated by field
    if cfg.wants_audio and cfg.ref_audio is None:
        raise RealtimeError(
            "ref_audio_required", "ref_audio is required when audio is an output modality", param="ref_audio"
        )
    return cfg


def _apply_audio_formats(cfg: SessionConfig, obj: dict[str, Any], opening: bool) -> None:
    """1. Input and output audio formats and rates."""
    in_spec = obj.get("input_audio_format", _get(obj, "audio", "input", "format"))
    fmt, rate = _format_and_rate(in_spec, "input_audio_format")
    declared_rate = obj.get("sample_rate_hz", _get(obj, "audio", "input", "sample_rate_hz"))
    if fmt is not None:
        cfg.input_format = fmt
        cfg.input_rate = rate or default_rate_for(fmt)
    if declared_rate is not None:
        cfg.input_rate = validate_rate(declared_rate)
    elif opening and rate is None and obj.get("type") == "realtime" and cfg.input_format == "pcm16":
        # A GA session object (``type: "realtime"``, which the vLLM-Omni dialect never sends) that declares
        # no input rate means OpenAI's default, 24 kHz PCM; the dialect's own default stays 16 kHz.
        cfg.input_rate = GA_PCM_RATE
    out_spec = obj.get("output_audio_format", _get(obj, "audio", "output", "format"))
    out_fmt = _output_format(out_spec)
    if out_fmt is not None:
        cfg.output_format = out_fmt
    out_rate = _get(obj, "audio", "output", "sample_rate_hz")
    if out_rate is not None and out_rate != 24_000 and cfg.output_format in ("pcm16", "wav"):
        raise RealtimeError(
            "unsupported_audio_format", "output audio is 24000 Hz", param="audio.output.sample_rate_hz"
        )


def _apply_turn_taking(cfg: SessionConfig, obj: dict[str, Any], opening: bool) -> None:
    """2. Overlap policy, turn detection (server VAD), playback commit policy."""
    if "overlap_policy" in obj:
        cfg.overlap_policy = (
            obj["overlap_policy"] if obj["overlap_policy"] in OVERLAP_POLICIES else "listen_only"
        )
    audio_input = _get(obj, "audio", "input")
    if "turn_detection" not in obj and isinstance(audio_input, dict) and "turn_detection" in audio_input:
        obj = {**obj, "turn_detection": audio_input["turn_detection"]}  # GA's place for the same object
    if "turn_detection" in obj and "overlap_policy" not in obj:
        # The overlap policy follows the turn detection unless the client names one: server VAD speech
        # interrupts a running response (OpenAI's interrupt_response default), model-owned turn taking
        # lets the model decide (docs/realtime.md, Server VAD).
        td_new = obj["turn_detection"]
        server_vad = isinstance(td_new, dict) and td_new.get("type") == "server_vad"
        cfg.overlap_policy = "barge_in_on_speech" if server_vad else "listen_only"
    if "turn_detection" in obj or "overlap_policy" in obj or opening:
        td = obj["turn_detection"] if "turn_detection" in obj else cfg.turn_detection
        cfg.turn_detection = _validate_turn_detection(td, cfg.overlap_policy, opening)
    if "playback_commit_policy" in obj:
        value = obj["playback_commit_policy"]
        cfg.playback_commit_policy = value if value in PLAYBACK_POLICIES else "ack_only"


def _apply_fixed_at_open(
    cfg: SessionConfig, obj: dict[str, Any], extra: dict[str, Any], opening: bool, audio_started: bool
) -> None:
    """3. Identity-bearing fields (model, reference voice, voice, instructions, context window): set at
    open, refused as a live change."""
    model = obj.get("model")
    if model is not None:
        if not opening and model != cfg.model:
            raise RealtimeError(
                "model_update_unsupported", "the model cannot change within a session", param="model"
            )
        cfg.model = str(model)
    owned = sorted(SERVER_OWNED_EXTRA_KEYS & extra.keys())
    if owned:
        raise RealtimeError(
            "invalid_session_config", f"extra_body keys are server-owned: {owned}", param="extra_body"
        )
    if "ref_audio_path" in extra or "tts_ref_audio_path" in extra or "ref_audio_path" in obj:
        raise RealtimeError(
            "unsupported_ref_audio_path", "ref audio must be inline, not a path", param="ref_audio"
        )
    ref_uri = obj.get("ref_audio") or extra.get("ref_audio") or extra.get("tts_ref_audio")
    if ref_uri is not None:
        if not opening:
            raise RealtimeError(
                "ref_audio_update_unsupported", "ref_audio is fixed at open", param="ref_audio"
            )
        cfg.ref_audio = decode_ref_audio(ref_uri)
        cfg.ref_audio_uri = ref_uri
    voice = obj.get("voice", _get(obj, "audio", "output", "voice"))
    if voice is not None:
        if not opening and audio_started and voice != cfg.voice:
            raise RealtimeError(
                "voice_update_after_audio_unsupported",
                "voice cannot change after audio started",
                param="voice",
            )
        cfg.voice = str(voice)
    if "instructions" in obj and obj["instructions"] is not None:
        text = str(obj["instructions"])
        if not opening and text != cfg.instructions:
            raise RealtimeError(
                "instructions_update_unsupported", "instructions are fixed at open", param="instructions"
            )
        cfg.instructions = text
    for knob in (
        "sliding_window_mode",
        "basic_window_high_tokens",
        "basic_window_low_tokens",
        "context_previous_max_tokens",
        "context_max_units",
    ):
        if knob in extra and not opening and extra[knob] != cfg.extra_body.get(knob):
            raise RealtimeError("sliding_window_update_unsupported", f"{knob} is fixed at open", param=knob)


def _apply_registered_voice(
    cfg: SessionConfig,
    obj: dict[str, Any],
    extra: dict[str, Any],
    voices: Callable[[str], Any] | None,
) -> None:
    """``voice`` naming a registered voice (/v1/audio/voices) supplies the reference clip and both stages'
    stored features (``RealtimeVoice``), unless ``ref_audio`` is given inline; an unknown name is refused."""
    if voices is None or cfg.voice is None or cfg.ref_audio_uri is not None:
        return
    from gateway.audio.voices import is_builtin

    if is_builtin(cfg.voice.lower()):
        return
    found = voices(cfg.voice)
    if found is None:
        raise RealtimeError("invalid_voice", f"unknown voice {cfg.voice!r}", param="voice")
    keep = (found.clip.size // (UNIT_RATE // 10)) * (UNIT_RATE // 10)
    cfg.ref_audio = np.asarray(found.clip[:keep], dtype=np.float32)
    cfg.voice_prompt = found.code2wav
    cfg.thinker_voice = found.thinker


def _apply_knobs(cfg: SessionConfig, obj: dict[str, Any], extra: dict[str, Any], opening: bool) -> None:
    """4. Plain knobs, changeable at any time (within the lane rules)."""
    mods = obj.get("output_modalities", obj.get("modalities"))
    if mods is not None:
        if not isinstance(mods, list) or not mods or any(m not in ("text", "audio") for m in mods):
            raise RealtimeError(
                "invalid_session_config", "modalities must be a subset of [text, audio]", param="modalities"
            )
        cfg.modalities = list(mods)
    numbers = {
        k: obj[k]
        for k in ("temperature", "idle_timeout_s", "max_response_output_tokens")
        if obj.get(k) is not None and not (k == "max_response_output_tokens" and obj[k] == "inf")
    }
    checked = _checked_numbers(_SessionNumbers, numbers, "")
    assert isinstance(checked, _SessionNumbers)
    if checked.temperature is not None:
        cfg.temperature = checked.temperature
    if obj.get("max_response_output_tokens") is not None:
        cfg.max_response_output_tokens = checked.max_response_output_tokens
    if checked.idle_timeout_s is not None:
        cfg.idle_timeout_s = checked.idle_timeout_s
    if "metadata" in obj:
        cfg.metadata = obj["metadata"]
    if "auto_response" in extra:
        cfg.auto_response = bool(extra["auto_response"])
    extra_numbers = {
        k: extra[k] for k in ("force_listen_count", "max_response_units") if extra.get(k) is not None
    }
    checked_extra = _checked_numbers(_ExtraNumbers, extra_numbers, "extra_body.")
    assert isinstance(checked_extra, _ExtraNumbers)
    if checked_extra.force_listen_count is not None:
        cfg.force_listen_count = checked_extra.force_listen_count
    if checked_extra.max_response_units is not None:
        cfg.max_response_units = checked_extra.max_response_units
    seed_text = extra.get("duplex_initial_user_text", obj.get("initial_user_text"))
    if seed_text is not None:
        cfg.initial_user_text = str(seed_text)
    cfg.extra_body = {**cfg.extra_body, **extra}


GA_PCM_RATE = 24_000
# The GA (MIME) names of the nested ``audio.*.format.type``; the flat beta keys keep the dialect's names.
_GA_FORMAT_TYPES = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}


def ga_format(fmt: str, rate: int) -> dict[str, Any]:
    """``{"type": "audio/pcm", "rate": 24000}``-style format object; formats GA lacks keep our name."""
    return {"type": _GA_FORMAT_TYPES.get(fmt, fmt), "rate": rate}


def render_session(cfg: SessionConfig) -> dict[str, Any]:
    """The configuration part of the session object echoed in session.created/updated."""
    return {
        "model": cfg.model,
        "modalities": list(cfg.modalities),
        "instructions": cfg.instructions,
        "voice": cfg.voice,
        "input_audio_format": cfg.input_format,
        "output_audio_format": cfg.output_format,
        "audio": {
            "input": {
                "format": ga_format(cfg.input_format, cfg.input_rate),
                "sample_rate_hz": cfg.input_rate,
                "turn_detection": cfg.turn_detection,
            },
            "output": {
                "format": ga_format(
                    cfg.output_format, 8_000 if cfg.output_format.startswith("g711") else 24_000
                )
            },
        },
        "turn_detection": cfg.turn_detection,
        "temperature": cfg.temperature,
        "max_response_output_tokens": "inf"
        if cfg.max_response_output_tokens is None
        else cfg.max_response_output_tokens,
        "idle_timeout_s": cfg.idle_timeout_s,
        "overlap_policy": cfg.overlap_policy,
        "playback_commit_policy": cfg.playback_commit_policy,
        "extra_body": {k: v for k, v in cfg.extra_body.items() if k not in ("ref_audio", "tts_ref_audio")},
        "metadata": cfg.metadata,
        "tools": cfg.tools.render_tools(),
        "tool_choice": cfg.tools.render_choice(),
    }
