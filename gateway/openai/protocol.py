"""Validation of ``POST /v1/chat/completions`` bodies (docs/protocol.md, Chat request) into a
:class:`ChatRequest`.

This module is the gateway's one request-validation layer: the body (OpenAI's fields and the vLLM-Omni
extensions ``sampling_params_list``, ``ref_audio``, ``chat_template_kwargs``) is validated by the pydantic
models of :mod:`gateway.openai.request_models` before any media is decoded or any stage is contacted, and
the route only ever sees the typed dataclasses below. Every refusal is OpenAI's ``invalid_request_error``
envelope with a reason ``code`` (``invalid_value``, ``invalid_type``, ``missing_required_parameter``, ...)
and ``param`` set to the JSON path of the field the client must fix (``tools[0].function.name``,
``messages[2].tool_call_id``), mapped here from the first pydantic error. Media are only checked for shape;
fetching and decoding happen in :mod:`gateway.openai.content`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from pydantic import ValidationError

from gateway.openai.errors import APIError, invalid_request
from gateway.openai.request_models import (
    MAX_STOP,
    MAX_TOP_LOGPROBS,
    NAME_RE,
    OUTPUT_MODALITIES,
    ROLES,
    AnyMessage,
    AssistantMessage,
    AudioURLPart,
    ChatCompletionRequest,
    DeveloperMessage,
    ImageURLPart,
    InputAudioPart,
    JSONObjectFormat,
    JSONSchemaFormat,
    MediaURL,
    TextPart,
    ToolChoiceFunction,
    ToolMessage,
    VideoURLPart,
    describe_error,
    error_code_and_message,
    error_loc,
)
from gateway.tool_calls import ToolChoice, ToolSpec
from gateway.validation_types import FLOAT32_MAX, INT32_MAX, UINT32_MAX, UINT64_MAX

__all__ = [
    "FLOAT32_MAX",
    "INT32_MAX",
    "MAX_STOP",
    "MAX_TOP_LOGPROBS",
    "NAME_RE",
    "OUTPUT_MODALITIES",
    "ROLES",
    "UINT32_MAX",
    "UINT64_MAX",
    "ChatRequest",
    "ContentPart",
    "Message",
    "OpenAIAudio",
    "ResponseFormat",
    "ToolCall",
    "ToolChoice",
    "ToolSpec",
    "parse_chat_request",
]

# The default output when a body names no ``modalities`` (the deploy profile may give another through
# ``parse_chat_request(default_modalities=...)``).
DEFAULT_MODALITIES: tuple[str, ...] = ("text",)
# Fields whose faults are reported at the field itself rather than inside it (OpenAI names the field).
_WHOLE_FIELDS = frozenset({"modalities", "stop", "tool_choice"})


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
    logit_bias: dict[int, float] = field(default_factory=dict)
    openai_audio: OpenAIAudio | None = None

    @property
    def want_audio(self) -> bool:
        return "audio" in self.modalities

    @property
    def want_text(self) -> bool:
        return "text" in self.modalities


def _api_error(exc: ValidationError) -> APIError:
    """The first pydantic error as OpenAI's envelope: reason code, the field's JSON path, a specific message."""
    err = exc.errors(include_url=False)[0]
    loc = error_loc(err)
    if loc and loc[0] in _WHOLE_FIELDS:
        loc = loc[:1]
    param, code, message = describe_error(err, loc)
    if param is None:
        return invalid_request("request body must be a JSON object", None, "invalid_type")
    if code == "model_not_found":
        return invalid_request(error_code_and_message(err)[1], param, code, status=404)
    return invalid_request(message, param, code)


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
    try:
        req = ChatCompletionRequest.model_validate(
            body, context={"served_model_name": served_model_name, "max_model_len": max_model_len}
        )
    except ValidationError as exc:
        raise _api_error(exc) from None
    modalities = list(dict.fromkeys(req.modalities if req.modalities is not None else default_modalities))
    want_audio = "audio" in modalities
    opts = req.stream_options
    tpl = req.chat_template_kwargs
    thinker = req.thinker_sampling()
    tools = [
        ToolSpec(
            t.function.name,
            t.function.description,
            t.function.parameters
            if t.function.parameters is not None
            else {"type": "object", "properties": {}},
            bool(t.function.strict),
        )
        for t in req.tools or []
    ]
    openai_audio = None
    audio_format = "wav"
    if req.audio is not None:
        audio_format = req.audio.format or audio_format
        fmt = "pcm16" if audio_format == "pcm" else audio_format
        openai_audio = OpenAIAudio(req.audio.voice, cast(Any, fmt))
    return ChatRequest(
        model=req.model or served_model_name,
        messages=[_message(i, cast(AnyMessage, m)) for i, m in enumerate(req.messages)],
        modalities=modalities,
        audio_format=audio_format,
        stream=bool(req.stream),
        include_usage=bool(opts and opts.include_usage),
        continuous_usage_stats=bool(opts and opts.continuous_usage_stats),
        use_tts_template=want_audio if tpl is None or tpl.use_tts_template is None else tpl.use_tts_template,
        enable_thinking=bool(tpl and tpl.enable_thinking),
        ref_audio=req.extra_ref_audio(),
        thinker_sampling=thinker,
        talker_sampling=req.talker_sampling(),
        return_stage_metrics=bool(req.return_stage_metrics),
        tools=tools,
        tool_choice=_tool_choice(req.tool_choice, bool(tools)),
        parallel_tool_calls=req.parallel_tool_calls is not False,
        response_format=_response_format(req.response_format),
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs,
        seed=thinker.get("seed"),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()},
        openai_audio=openai_audio,
    )


def _message(i: int, msg: AnyMessage) -> Message:
    """A validated message as the route's :class:`Message` (``developer`` is the system role)."""
    where = f"messages[{i}].content"
    parts: list[ContentPart] = []
    if isinstance(msg.content, str):
        parts.append(ContentPart("text", where, text=msg.content))
    elif isinstance(msg.content, list):
        for j, raw in enumerate(msg.content):
            param = f"{where}[{j}]"
            if isinstance(raw, str):
                parts.append(ContentPart("text", param, text=raw))
            elif isinstance(raw, TextPart):
                parts.append(ContentPart("text", param, text=raw.text))
            elif isinstance(raw, InputAudioPart):
                audio = raw.input_audio
                parts.append(ContentPart("input_audio", param, data=audio.data, format=audio.format))
            elif isinstance(raw, (ImageURLPart, AudioURLPart, VideoURLPart)):
                ref = getattr(raw, raw.type)
                parts.append(ContentPart(raw.type, param, url=ref.url if isinstance(ref, MediaURL) else ref))
    tool_calls = []
    if isinstance(msg, AssistantMessage):
        tool_calls = [ToolCall(c.id, c.function.name, c.function.arguments) for c in msg.tool_calls or []]
    return Message(
        "system" if isinstance(msg, DeveloperMessage) else msg.role,
        parts,
        tool_calls=tool_calls,
        tool_call_id=msg.tool_call_id if isinstance(msg, ToolMessage) else None,
        name=msg.name,
    )


def _tool_choice(raw: object, have_tools: bool) -> ToolChoice:
    """``tool_choice`` normalised; "auto" when tools are given without one, "none" when there are none."""
    if raw is None:
        return ToolChoice("auto" if have_tools else "none")
    if isinstance(raw, ToolChoiceFunction):
        return ToolChoice("function", raw.function.name)
    return ToolChoice(cast(Literal["auto", "none", "required"], raw))


def _response_format(raw: object) -> ResponseFormat | None:
    """``{"type": "text"}`` (the default) is None; the JSON modes as :class:`ResponseFormat`."""
    if isinstance(raw, JSONObjectFormat):
        return ResponseFormat("json_object")
    if isinstance(raw, JSONSchemaFormat):
        spec = raw.json_schema
        return ResponseFormat("json_schema", spec.name, spec.schema_, bool(spec.strict))
    return None
