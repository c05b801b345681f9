"""Validation of ``POST /v1/chat/completions`` bodies (docs/protocol.md, Chat request) into a
:class:`ChatRequest`.

This module is the gateway's one request-validation layer: every field of the OpenAI chat body (and the
vLLM-Omni extensions ``sampling_params_list``, ``ref_audio``, ``chat_template_kwargs``) is checked here,
before any media is decoded or any stage is contacted, and the route only ever sees typed attributes.
Every refusal is OpenAI's ``invalid_request_error`` envelope with a reason ``code`` (``invalid_value``,
``invalid_type``, ``missing_required_parameter``, ...) and ``param`` set to the JSON path of the field the
client must fix (``tools[0].function.name``, ``messages[2].tool_call_id``). The checks are explicit code
rather than a pydantic model of the body because each needs its own path and code, including paths into
lists and cross-field rules (a ``tool_choice`` naming an undeclared function, a ``tool_call_id`` matching an
earlier assistant call); :mod:`gateway.openai.openapi_schema` describes the same body for ``/openapi.json``.
Media are only checked for shape here; fetching and decoding happen in :mod:`gateway.openai.content`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.audio_encoding import normalize_format
from gateway.openai.errors import APIError, invalid_request
from services.common.deploy_profile import TALKER_SAMPLING_KEYS, THINKER_SAMPLING_KEYS

OUTPUT_MODALITIES = ("text", "audio")
ROLES = ("system", "developer", "user", "assistant", "tool")
# The default output when a body names no ``modalities`` (the deploy profile may give another through
# ``parse_chat_request(default_modalities=...)``).
DEFAULT_MODALITIES: tuple[str, ...] = ("text",)
# OpenAI's limits: function / schema names, stop strings, top_logprobs.
NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
OPENAI_AUDIO_FORMATS = ("wav", "pcm16", "mp3", "flac", "opus")
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
class ToolCall:
    """An assistant message's earlier call of a declared function (``arguments`` as the JSON text sent)."""

    id: str
    name: str
    arguments: str


@dataclass
class Message:
    role: str
    parts: list[ContentPart]
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None  # role "tool": the assistant call this message answers
    name: str | None = None


@dataclass
class ToolSpec:
    """A declared ``{"type": "function"}`` tool; ``parameters`` is a checked JSON Schema."""

    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool = False


@dataclass
class ToolChoice:
    """``tool_choice`` normalised: ``mode`` "function" carries the forced function's ``name``."""

    mode: Literal["auto", "none", "required", "function"]
    name: str | None = None


@dataclass
class ResponseFormat:
    """``response_format`` other than text (``{"type": "text"}`` is normalised to ``None``)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool = False


@dataclass
class OpenAIAudio:
    """OpenAI's ``audio`` output object, present exactly when the body carries one."""

    voice: str
    format: Literal["wav", "pcm16", "mp3", "flac", "opus"]


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
    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    openai_audio: OpenAIAudio | None = None

    @property
    def want_audio(self) -> bool:
        return "audio" in self.modalities

    @property
    def want_text(self) -> bool:
        return "text" in self.modalities


def _bad(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return invalid_request(message, param, code)


def _expect(value: Any, types: type | tuple[type, ...], param: str, what: str) -> Any:
    if value is None:
        raise _bad(f"'{param}' is required ({what})", param, "missing_required_parameter")
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise _bad(f"'{param}' must be {what}, got a boolean", param, "invalid_type")
    if not isinstance(value, types):
        raise _bad(f"'{param}' must be {what}, got {type(value).__name__}", param, "invalid_type")
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


def _parse_tool_calls(raw: Any, param: str) -> list[ToolCall]:
    """An assistant message's ``tool_calls``: ``[{id, type: "function", function: {name, arguments}}]``."""
    _expect(raw, list, param, "a list of tool calls")
    calls: list[ToolCall] = []
    for j, call in enumerate(raw):
        where = f"{param}[{j}]"
        _expect(call, dict, where, "an object")
        call_id = _expect(call.get("id"), str, f"{where}.id", "a string")
        if not call_id:
            raise _bad(f"'{where}.id' is empty", f"{where}.id")
        if call.get("type", "function") != "function":
            raise _bad(f"'{where}.type' must be 'function', got {call.get('type')!r}", f"{where}.type")
        fn = _expect(call.get("function"), dict, f"{where}.function", "an object")
        name = _expect(fn.get("name"), str, f"{where}.function.name", "a string")
        if not NAME_RE.match(name):
            raise _bad(
                f"'{where}.function.name' must match {NAME_RE.pattern}, got {name[:80]!r}",
                f"{where}.function.name",
            )
        arguments = _expect(fn.get("arguments"), str, f"{where}.function.arguments", "a JSON string")
        calls.append(ToolCall(call_id, name, arguments))
    return calls


def _parse_messages(raw: Any) -> list[Message]:
    if raw is None:
        raise _bad("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty list", "messages")
    out: list[Message] = []
    call_ids: set[str] = set()
    for i, msg in enumerate(raw):
        param = f"messages[{i}]"
        _expect(msg, dict, param, "an object")
        role = msg.get("role")
        if role not in ROLES:
            raise _bad(f"'{param}.role' must be one of {list(ROLES)}, got {role!r}", f"{param}.role")
        tool_calls: list[ToolCall] = []
        if role == "assistant" and msg.get("tool_calls") is not None:
            tool_calls = _parse_tool_calls(msg["tool_calls"], f"{param}.tool_calls")
        content = msg.get("content")
        if content is None:
            if role != "assistant":
                raise _bad(f"'{param}.content' is required", f"{param}.content", "missing_required_parameter")
            parts: list[ContentPart] = []
        elif isinstance(content, str):
            parts = [ContentPart("text", f"{param}.content", text=content)]
        elif isinstance(content, list):
            parts = [_parse_part(p, f"{param}.content[{j}]") for j, p in enumerate(content)]
        else:
            raise _bad(
                f"'{param}.content' must be a string or a list of content parts",
                f"{param}.content",
                "invalid_type",
            )
        if role != "user":
            for part in parts:
                if part.type != "text":
                    raise _bad(f"'{part.param}': {role} messages may only contain text", part.param)
        tool_call_id: str | None = None
        if role == "tool":
            tool_call_id = _expect(msg.get("tool_call_id"), str, f"{param}.tool_call_id", "a string")
            if tool_call_id not in call_ids:
                raise _bad(
                    f"'{param}.tool_call_id' {tool_call_id[:80]!r} answers no earlier assistant tool call",
                    f"{param}.tool_call_id",
                )
        name = msg.get("name")
        if name is not None:
            _expect(name, str, f"{param}.name", "a string")
        call_ids.update(c.id for c in tool_calls)
        out.append(
            Message(
                "system" if role == "developer" else role,
                parts,
                tool_calls=tool_calls,
                tool_call_id=tool_call_id,
                name=name,
            )
        )
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


def parse_chat_request(
    body: object,
    served_model_name: str,
    max_model_len: int | None = None,
    default_modalities: Sequence[str] = DEFAULT_MODALITIES,
) -> ChatRequest:
    """Validate a decoded JSON body; raises :class:`APIError` (400, or 404 for an unknown model).

    ``max_model_len`` is the thinker context from the deploy profile (None: not checked here);
    ``default_modalities`` the output when the body names no ``modalities``.
    """
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", None, "invalid_type")
    model = body.get("model", served_model_name)
    _expect(model, str, "model", "a string")
    if model != served_model_name:
        raise APIError(
            404,
            f"The model `{model}` does not exist. This server serves `{served_model_name}`.",
            "model",
            "invalid_request_error",
            code="model_not_found",
        )
    messages = _parse_messages(body.get("messages"))

    modalities, audio_format, openai_audio = _parse_output(body, default_modalities)

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
        raise _bad("MiniCPM-o 4.5 chat ref_audio must be a URI string", "ref_audio", "invalid_type")

    _refuse_unsupported(body)
    tools = _parse_tools(body.get("tools"))
    tool_choice = _parse_tool_choice(body.get("tool_choice"), tools)
    logprobs = _opt_bool(body, "logprobs", False)
    top_logprobs = _opt_int(body, "top_logprobs", 0)
    if top_logprobs is not None:
        if top_logprobs > MAX_TOP_LOGPROBS:
            raise _bad(
                f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {top_logprobs}", "top_logprobs"
            )
        if not logprobs:
            raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
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
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=_opt_bool(body, "parallel_tool_calls", True),
        response_format=_parse_response_format(body.get("response_format")),
        stop=_parse_stop(body.get("stop")),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        seed=thinker.get("seed"),
        presence_penalty=_opt_number(body, "presence_penalty", -2.0, 2.0) or 0.0,
        frequency_penalty=_opt_number(body, "frequency_penalty", -2.0, 2.0) or 0.0,
        openai_audio=openai_audio,
    )


def _parse_output(
    body: dict[str, Any], default_modalities: Sequence[str]
) -> tuple[list[str], str, OpenAIAudio | None]:
    """``modalities`` and ``audio``: what the response carries, and OpenAI's audio object when sent."""
    modalities = body.get("modalities")
    if modalities is None:
        modalities = list(default_modalities)
    if not isinstance(modalities, list):
        raise _bad('\'modalities\' must be a list such as ["text", "audio"]', "modalities", "invalid_type")
    if not modalities or any(m not in OUTPUT_MODALITIES for m in modalities):
        raise _bad(
            f"Unsupported output modalities {modalities!r}; this model outputs {list(OUTPUT_MODALITIES)}",
            "modalities",
        )

    audio_format = "wav"
    audio = body.get("audio")
    if audio is None:
        return modalities, audio_format, None
    _expect(audio, dict, "audio", "an object")
    if audio.get("format") is not None:
        fmt = normalize_format(audio["format"])
        if fmt is None:
            raise _bad(
                f"Unsupported audio format {audio['format']!r}; supported: {list(OPENAI_AUDIO_FORMATS)}",
                "audio.format",
            )
        audio_format = fmt
    voice = audio.get("voice", "default")
    _expect(voice, str, "audio.voice", "a string")
    if not voice:
        raise _bad("'audio.voice' is empty", "audio.voice")
    openai_fmt = "pcm16" if audio_format == "pcm" else audio_format
    if openai_fmt not in OPENAI_AUDIO_FORMATS:
        raise _bad(
            f"Unsupported audio format {audio['format']!r}; supported: {list(OPENAI_AUDIO_FORMATS)}",
            "audio.format",
        )
    return modalities, audio_format, OpenAIAudio(voice=voice, format=openai_fmt)  # type: ignore[arg-type]


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """OpenAI options this server does not implement: refused with 400 rather than ignored."""
    n = _opt_int(body, "n", 1)
    if n not in (None, 1):
        raise _bad("only n=1 is supported", "n", "unsupported_value")
    if body.get("functions"):
        raise _bad(
            "'functions' (the deprecated tool API) is not supported; use 'tools'",
            "functions",
            "unsupported_parameter",
        )


def _check_json_schema(schema: Any, param: str) -> dict[str, Any]:
    """``schema`` as a dict if it is a valid JSON Schema (checked against its own metaschema)."""
    import jsonschema

    _expect(schema, dict, param, "a JSON Schema object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise _bad(
            f"'{param}' is not a valid JSON Schema: {exc.message[:200]} (at '/{where}')", param
        ) from exc
    except (TypeError, AttributeError, ValueError) as exc:  # e.g. a "$schema" that is not a string
        raise _bad(f"'{param}' is not a valid JSON Schema: {type(exc).__name__}", param) from exc
    return schema


def _parse_tools(raw: Any) -> list[ToolSpec]:
    """``tools``: function tools only, each name unique and each ``parameters`` a valid JSON Schema."""
    if raw is None:
        return []
    _expect(raw, list, "tools", "a list of tools")
    tools: list[ToolSpec] = []
    seen: set[str] = set()
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        _expect(tool, dict, where, "an object")
        if tool.get("type") != "function":
            raise _bad(f"'{where}.type' must be 'function', got {tool.get('type')!r}", f"{where}.type")
        fn = _expect(tool.get("function"), dict, f"{where}.function", "an object")
        name = _expect(fn.get("name"), str, f"{where}.function.name", "a string")
        if not NAME_RE.match(name):
            raise _bad(
                f"'{where}.function.name' must match {NAME_RE.pattern}, got {name[:80]!r}",
                f"{where}.function.name",
            )
        if name in seen:
            raise _bad(
                f"'{where}.function.name': the function {name!r} is declared twice", f"{where}.function.name"
            )
        seen.add(name)
        description = fn.get("description")
        if description is not None:
            _expect(description, str, f"{where}.function.description", "a string")
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        else:
            parameters = _check_json_schema(parameters, f"{where}.function.parameters")
        strict = _opt_bool(fn, "strict", False, f"{where}.function.strict")
        tools.append(ToolSpec(name, description, parameters, strict))
    return tools


def _parse_tool_choice(raw: Any, tools: list[ToolSpec]) -> ToolChoice:
    """``tool_choice`` normalised; "auto" when tools are given without one, "none" when there are none."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise _bad(
                f"'tool_choice' must be 'auto', 'none', 'required' or a function, got {raw[:40]!r}",
                "tool_choice",
            )
        if raw != "none" and not tools:
            raise _bad(f"'tool_choice' {raw!r} needs 'tools'", "tool_choice")
        return ToolChoice(raw)  # type: ignore[arg-type]
    _expect(raw, dict, "tool_choice", "a string or an object")
    if raw.get("type") != "function":
        raise _bad(f"'tool_choice.type' must be 'function', got {raw.get('type')!r}", "tool_choice")
    fn = _expect(raw.get("function"), dict, "tool_choice", "an object with 'function': {'name': ...}")
    name = _expect(fn.get("name"), str, "tool_choice", "an object with a function name")
    if name not in {t.name for t in tools}:
        raise _bad(
            f"'tool_choice' names the function {name[:80]!r}, which 'tools' does not declare", "tool_choice"
        )
    return ToolChoice("function", name)


def _parse_response_format(raw: Any) -> ResponseFormat | None:
    """``response_format``: text (normalised to None), ``json_object``, or ``json_schema`` with a valid schema."""
    if raw is None:
        return None
    _expect(raw, dict, "response_format", "an object")
    rtype = raw.get("type")
    if rtype == "text":
        return None
    if rtype == "json_object":
        return ResponseFormat("json_object")
    if rtype != "json_schema":
        raise _bad(
            f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {rtype!r}",
            "response_format.type",
        )
    spec = _expect(raw.get("json_schema"), dict, "response_format.json_schema", "an object")
    name = _expect(spec.get("name"), str, "response_format.json_schema.name", "a string")
    if not NAME_RE.match(name):
        raise _bad(
            f"'response_format.json_schema.name' must match {NAME_RE.pattern}, got {name[:80]!r}",
            "response_format.json_schema.name",
        )
    schema = spec.get("schema")
    if schema is not None:
        schema = _check_json_schema(schema, "response_format.json_schema.schema")
    strict = _opt_bool(spec, "strict", False, "response_format.json_schema.strict")
    return ResponseFormat("json_schema", name, schema, strict)


def _parse_stop(raw: Any) -> list[str]:
    """``stop``: a string or a list of 1..4 non-empty strings."""
    if raw is None:
        return []
    if isinstance(raw, str):
        raw = [raw]
    elif not isinstance(raw, list):
        raise _bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if not 1 <= len(raw) <= MAX_STOP:
        raise _bad(f"'stop' holds 1 to {MAX_STOP} strings, got {len(raw)}", "stop")
    for item in raw:
        if not isinstance(item, str):
            raise _bad(f"'stop' must hold strings, got {type(item).__name__}", "stop", "invalid_type")
        if not item:
            raise _bad("'stop' strings must not be empty", "stop")
    return list(raw)


def _parse_sampling(body: dict[str, Any], max_model_len: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The thinker's and the talker's sampling: top-level OpenAI keys, then ``sampling_params_list``."""
    thinker: dict[str, Any] = {}
    max_tokens = _opt_int(body, "max_completion_tokens", 1)
    legacy = _opt_int(body, "max_tokens", 1)
    if max_tokens is not None and legacy is not None and legacy != max_tokens:
        raise _bad(
            f"'max_completion_tokens' ({max_tokens}) and its older alias 'max_tokens' ({legacy}) disagree",
            "max_completion_tokens",
        )
    if max_tokens is None:
        max_tokens = legacy
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
