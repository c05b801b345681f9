"""Validation of ``POST /v1/chat/completions`` bodies (docs/protocol.md, Chat request) into a
:class:`ChatRequest`.

Validation is explicit rather than a pydantic model because every refusal must name the offending
field (``param``) in the error envelope and pick the right status (400 bad value, 404 unknown model),
and because vLLM-Omni extensions (``sampling_params_list``, ``ref_audio``, ``chat_template_kwargs``) have
their own rules. Media are only checked for shape here; fetching and decoding happen in
:mod:`gateway.openai.content`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gateway.audio_encoding import SUPPORTED_FORMATS, normalize_format
from gateway.openai.errors import APIError
from services.common.deploy_profile import TALKER_SAMPLING_KEYS, THINKER_SAMPLING_KEYS

OUTPUT_MODALITIES = ("text", "audio")
ROLES = ("system", "developer", "user", "assistant")
PART_TYPES = ("text", "image_url", "input_audio", "audio_url", "video_url")
# vLLM SamplingParams keys that have no meaning for this model's stages; accepted and ignored so
# vLLM-Omni clients that send them keep working.
_IGNORED_SAMPLING_KEYS = frozenset(
    {
        "detokenize",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "output_kind",
        "n",
        "logprobs",
        "prompt_logprobs",
        "include_stop_str_in_output",
        "frequency_penalty",
        "presence_penalty",
        "stop",
    }
)
# vLLM names for the talker's budget keys.
_TALKER_ALIASES = {"max_tokens": "max_new_frames", "min_tokens": "min_new_frames"}


@dataclass
class ContentPart:
    """A content part as sent, with its JSON path for error messages."""

    type: str
    param: str
    text: str | None = None
    url: str | None = None  # image_url / audio_url / video_url
    data: str | None = None  # input_audio base64
    format: str | None = None  # input_audio format


@dataclass
class Message:
    role: str
    parts: list[ContentPart]


@dataclass
class ChatRequest:
    model: str
    messages: list[Message]
    modalities: list[str]
    audio_format: str
    stream: bool
    include_usage: bool
    continuous_usage_stats: bool
    use_tts_template: bool
    enable_thinking: bool
    ref_audio: str | None
    thinker_sampling: dict[str, Any] = field(default_factory=dict)
    talker_sampling: dict[str, Any] = field(default_factory=dict)
    return_stage_metrics: bool = False

    @property
    def want_audio(self) -> bool:
        return "audio" in self.modalities

    @property
    def want_text(self) -> bool:
        return "text" in self.modalities


def _bad(message: str, param: str | None) -> APIError:
    return APIError(400, message, param)


def _expect(value: Any, types: type | tuple[type, ...], param: str, what: str) -> Any:
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise _bad(f"'{param}' must be {what}, got a boolean", param)
    if not isinstance(value, types):
        raise _bad(f"'{param}' must be {what}, got {type(value).__name__}", param)
    return value


# What the stage protos can hold (thinker.proto / talker.proto): a value outside is a 400 here rather
# than a protobuf ValueError (a 500) when the request is built.
UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
FLOAT32_MAX = 3.4028234663852886e38
_INT_MAX = {"top_k": INT32_MAX, "seed": UINT64_MAX, "stop_token_ids": INT32_MAX}  # others are uint32


def _number(value: Any, param: str) -> float:
    """A finite number that fits the stages' float32 fields."""
    _expect(value, (int, float), param, "a number")
    try:
        out = float(value)
    except OverflowError:  # an integer too large for a double
        out = math.inf
    if not math.isfinite(out) or abs(out) > FLOAT32_MAX:
        raise _bad(f"'{param}' must be a finite number", param)
    return out


def _int_in_range(value: Any, param: str, name: str, lo: int) -> int:
    v = int(_expect(value, int, param, "an integer"))
    hi = _INT_MAX.get(name, UINT32_MAX)
    if v < lo or v > hi:
        raise _bad(f"'{param}' must be between {lo} and {hi}, got {v}", param)
    return v


def _opt_number(
    body: dict[str, Any], key: str, lo: float | None = None, hi: float | None = None
) -> float | None:
    if body.get(key) is None:
        return None
    value = _number(body[key], key)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise _bad(f"'{key}' must be between {lo} and {hi}, got {value}", key)
    return value


def _opt_int(body: dict[str, Any], key: str, lo: int | None = None) -> int | None:
    if body.get(key) is None:
        return None
    return _int_in_range(body[key], key, key, lo if lo is not None else -(2**63))


def _opt_bool(body: dict[str, Any], key: str, default: bool, where: str | None = None) -> bool:
    if body.get(key) is None:
        return default
    return bool(_expect(body[key], bool, where or key, "a boolean"))


def _parse_part(raw: Any, param: str) -> ContentPart:
    if isinstance(raw, str):
        return ContentPart("text", param, text=raw)
    _expect(raw, dict, param, "an object")
    ptype = raw.get("type")
    if ptype not in PART_TYPES:
        raise _bad(f"'{param}.type' must be one of {list(PART_TYPES)}, got {ptype!r}", f"{param}.type")
    if ptype == "text":
        return ContentPart("text", param, text=_expect(raw.get("text"), str, f"{param}.text", "a string"))
    if ptype == "input_audio":
        inner = _expect(raw.get("input_audio"), dict, f"{param}.input_audio", "an object")
        data = _expect(inner.get("data"), str, f"{param}.input_audio.data", "a base64 string")
        fmt = inner.get("format")
        if fmt is not None:
            _expect(fmt, str, f"{param}.input_audio.format", "a string")
        return ContentPart("input_audio", param, data=data, format=fmt)
    inner = raw.get(ptype)
    if isinstance(inner, str):
        url = inner
    else:
        inner = _expect(inner, dict, f"{param}.{ptype}", "an object with a 'url'")
        url = _expect(inner.get("url"), str, f"{param}.{ptype}.url", "a URL string")
    if not url:
        raise _bad(f"'{param}.{ptype}.url' is empty", f"{param}.{ptype}.url")
    return ContentPart(ptype, param, url=url)


def _parse_messages(raw: Any) -> list[Message]:
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty list", "messages")
    out: list[Message] = []
    for i, msg in enumerate(raw):
        param = f"messages[{i}]"
        _expect(msg, dict, param, "an object")
        role = msg.get("role")
        if role not in ROLES:
            raise _bad(f"'{param}.role' must be one of {list(ROLES)}, got {role!r}", f"{param}.role")
        content = msg.get("content")
        if content is None:
            if role != "assistant":
                raise _bad(f"'{param}.content' is required", f"{param}.content")
            parts: list[ContentPart] = []
        elif isinstance(content, str):
            parts = [ContentPart("text", f"{param}.content", text=content)]
        elif isinstance(content, list):
            parts = [_parse_part(p, f"{param}.content[{j}]") for j, p in enumerate(content)]
        else:
            raise _bad(f"'{param}.content' must be a string or a list of content parts", f"{param}.content")
        if role != "user":
            for part in parts:
                if part.type != "text":
                    raise _bad(f"'{part.param}': {role} messages may only contain text", part.param)
        out.append(Message("system" if role == "developer" else role, parts))
    if not any(m.role == "user" for m in out):
        raise _bad("'messages' must contain at least one user message", "messages")
    return out


def _parse_stage_sampling(raw: Any, stage: str, param: str) -> dict[str, Any]:
    if raw is None:
        return {}
    _expect(raw, dict, param, "an object")
    allowed = THINKER_SAMPLING_KEYS | {"stop_token_ids"} if stage == "thinker" else TALKER_SAMPLING_KEYS
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = _TALKER_ALIASES.get(key, key) if stage == "talker" else key
        if name in _IGNORED_SAMPLING_KEYS and name not in allowed:
            continue
        if name not in allowed:
            raise _bad(
                f"'{param}.{key}' is not a {stage} sampling parameter (allowed: {sorted(allowed)})",
                f"{param}.{key}",
            )
        if value is None:
            continue
        if name == "ignore_eos":
            out[name] = _expect(value, bool, f"{param}.{key}", "a boolean")
        elif name == "stop_token_ids":
            _expect(value, list, f"{param}.{key}", "a list of integers")
            out[name] = [_int_in_range(v, f"{param}.{key}[{i}]", name, 0) for i, v in enumerate(value)]
        elif name in (
            "top_k",
            "seed",
            "max_tokens",
            "min_tokens",
            "min_new_frames",
            "max_new_frames",
            "fixed_frames",
        ):
            v = _int_in_range(value, f"{param}.{key}", name, -1 if name == "top_k" else 0)
            out[name] = 0 if (name == "top_k" and v == -1) else v  # -1: vLLM's "disabled" spelling
        else:
            number = _number(value, f"{param}.{key}")
            if number < 0:
                raise _bad(f"'{param}.{key}' must be >= 0", f"{param}.{key}")
            out[name] = number
    return out


def _check_context(thinker: dict[str, Any], max_model_len: int | None) -> None:
    """Refuse token budgets no prompt could fit in the thinker context (OpenAI answers 400 too).

    The thinker still caps ``max_tokens`` to what the actual prompt leaves; this only catches budgets
    beyond the whole context, which used to run silently to the limit.
    """
    if max_model_len is None:
        return
    for key in ("max_tokens", "min_tokens"):
        value = thinker.get(key)
        if value is not None and value > max_model_len:
            raise _bad(
                f"'{key}' is too large: {value}. This model's context holds at most {max_model_len} tokens",
                key,
            )


def parse_chat_request(body: object, served_model_name: str, max_model_len: int | None = None) -> ChatRequest:
    """Validate a decoded JSON body; raises :class:`APIError` (400, or 404 for an unknown model).

    ``max_model_len`` is the thinker context from the deploy profile (None: not checked here).
    """
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", None)
    model = body.get("model", served_model_name)
    _expect(model, str, "model", "a string")
    if model != served_model_name:
        raise APIError(
            404,
            f"The model `{model}` does not exist. This server serves `{served_model_name}`.",
            "model",
            "NotFoundError",
        )
    messages = _parse_messages(body.get("messages"))

    modalities, audio_format = _parse_output(body)

    stream = _opt_bool(body, "stream", False)
    include_usage = continuous = False
    if body.get("stream_options") is not None:
        opts = _expect(body["stream_options"], dict, "stream_options", "an object")
        include_usage = _opt_bool(opts, "include_usage", False, "stream_options.include_usage")
        continuous = _opt_bool(opts, "continuous_usage_stats", False, "stream_options.continuous_usage_stats")

    want_audio = "audio" in modalities
    tpl = body.get("chat_template_kwargs") or {}
    _expect(tpl, dict, "chat_template_kwargs", "an object")
    use_tts = _opt_bool(tpl, "use_tts_template", want_audio, "chat_template_kwargs.use_tts_template")
    enable_thinking = _opt_bool(tpl, "enable_thinking", False, "chat_template_kwargs.enable_thinking")

    ref_audio = body.get("ref_audio")
    extra = body.get("extra_body")
    if ref_audio is None and isinstance(extra, dict):
        ref_audio = extra.get("ref_audio")
    if ref_audio is not None and not isinstance(ref_audio, str):
        raise _bad("MiniCPM-o 4.5 chat ref_audio must be a URI string", "ref_audio")

    _refuse_unsupported(body)
    thinker, talker = _parse_sampling(body, max_model_len)
    return ChatRequest(
        model=model,
        messages=messages,
        modalities=list(dict.fromkeys(modalities)),
        audio_format=audio_format,
        stream=stream,
        include_usage=include_usage,
        continuous_usage_stats=continuous,
        use_tts_template=use_tts,
        enable_thinking=enable_thinking,
        ref_audio=ref_audio,
        thinker_sampling=thinker,
        talker_sampling=talker,
        return_stage_metrics=_opt_bool(body, "return_stage_metrics", False),
    )


def _parse_output(body: dict[str, Any]) -> tuple[list[str], str]:
    """``modalities`` and ``audio.format``: what the response carries."""
    modalities = body.get("modalities")
    if modalities is None:
        modalities = list(OUTPUT_MODALITIES)
    if not isinstance(modalities, list):
        raise _bad('\'modalities\' must be a list such as ["text", "audio"]', "modalities")
    if not modalities or any(m not in OUTPUT_MODALITIES for m in modalities):
        raise _bad(
            f"Unsupported output modalities {modalities!r}; this model outputs {list(OUTPUT_MODALITIES)}",
            "modalities",
        )

    audio_format = "wav"
    audio = body.get("audio")
    if audio is not None:
        _expect(audio, dict, "audio", "an object")
        if audio.get("format") is not None:
            fmt = normalize_format(audio["format"])
            if fmt is None:
                raise _bad(
                    f"Unsupported audio format {audio['format']!r}; supported: "
                    f"{list(SUPPORTED_FORMATS) + ['pcm16']}",
                    "audio.format",
                )
            audio_format = fmt
    return modalities, audio_format


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """OpenAI options this server does not implement: refused with 400 rather than ignored."""
    n = _opt_int(body, "n", 1)
    if n not in (None, 1):
        raise _bad("only n=1 is supported", "n")
    if body.get("logprobs") is not None:
        if _opt_bool(body, "logprobs", False):
            raise _bad("logprobs are not supported by this server", "logprobs")
    stop = body.get("stop")
    if stop not in (None, [], ""):
        raise _bad("'stop' strings are not supported; use sampling_params_list[0].stop_token_ids", "stop")

    for key in ("tools", "functions"):
        if body.get(key):
            raise _bad(f"'{key}' (tool calling) is not supported by this server", key)
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise _bad('only response_format {"type": "text"} is supported', "response_format")


def _parse_sampling(body: dict[str, Any], max_model_len: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The thinker's and the talker's sampling: top-level OpenAI keys, then ``sampling_params_list``."""
    thinker: dict[str, Any] = {}
    max_tokens = _opt_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    if max_tokens is not None:
        thinker["max_tokens"] = max_tokens
    for key, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0), ("repetition_penalty", 0.0, 10.0)):
        v = _opt_number(body, key, lo, hi)
        if v is not None:
            thinker[key] = v
    for key in ("top_k", "seed", "min_tokens"):
        v = _opt_int(body, key, -1 if key == "top_k" else 0)
        if v is not None:
            thinker[key] = 0 if (key == "top_k" and v == -1) else v

    talker: dict[str, Any] = {}
    spl = body.get("sampling_params_list")
    if spl is not None:
        _expect(spl, list, "sampling_params_list", "a list of per-stage objects [thinker, talker]")
        if len(spl) > 3:
            raise _bad(
                "'sampling_params_list' has at most 3 entries (thinker, talker, code2wav)",
                "sampling_params_list",
            )
        if spl:
            thinker.update(_parse_stage_sampling(spl[0], "thinker", "sampling_params_list[0]"))
        if len(spl) > 1:
            talker.update(_parse_stage_sampling(spl[1], "talker", "sampling_params_list[1]"))
    _check_context(thinker, max_model_len)
    return thinker, talker
