"""Pydantic models of the ``POST /v1/chat/completions`` body (docs/protocol.md, Chat request).

The models are the one definition of the chat body: :func:`gateway.openai.protocol.parse_chat_request`
validates with them and :mod:`gateway.openai.openapi_schema` publishes their JSON schema. They are strict
(``"yes"`` is not a boolean, ``1.0`` not an integer). Every top-level field of OpenAI's request is declared
and either served, accepted with a documented harmless meaning, or refused (:data:`OPENAI_FIELDS`, the
same table as docs/api.md); an unknown top-level key is refused as ``unknown_parameter``, as OpenAI does.
Unknown keys inside objects are ignored (clients send back what responses carried: ``refusal``,
``annotations``, ``prompt_cache_breakpoint``, ...).

Union members are chosen by a callable discriminator whose tags start with ``#`` (the message ``role``, the
content part ``type``, the JSON kind of a ``str | list`` field), so a failing member reports its own fields
and :func:`error_path` can drop the tag from the error location. A discriminator routes a dict whose tag
field is wrong to a one-field model of that field (``_BadRole``, ``_BadPartType``), which yields an error
at ``messages[i].role`` / ``...content[j].type`` listing the allowed values; those helpers are left out of
the JSON schema.

Cross-field rules raise :class:`PydanticCustomError` whose type is the OpenAI reason ``code`` and whose
context may carry ``loc_suffix``: the path below the validator's own location where the fault is
(``messages`` + ``(2, "tool_call_id")``), since a validator cannot set the location itself.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from gateway.audio_encoding import normalize_format
from gateway.openai.errors import model_not_found_message
from gateway.validation_types import (
    FINITE32,
    INT32_MAX,
    NonNegativeFloat32,
    Penalty,
    PositiveUInt32,
    RepetitionPenalty,
    Seed,
    Temperature,
    TokenId,
    TopK,
    TopP,
    UInt32,
)

ROLES = ("system", "developer", "user", "assistant", "tool")
PART_TYPES = ("text", "image_url", "input_audio", "audio_url", "video_url")
OUTPUT_MODALITIES = ("text", "audio")
OPENAI_AUDIO_FORMATS = ("wav", "pcm16", "mp3", "flac", "opus")
# OpenAI's limits: function / schema names, stop strings, top_logprobs.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
NAME_RE = re.compile(NAME_PATTERN)
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries of logit_bias
MAX_METADATA = 16  # metadata pairs; keys up to 64 characters, values up to 512 (OpenAI's limits)
# How this server treats each top-level field of OpenAI's chat completions request (the openai SDK's
# CompletionCreateParams): "yes" served as OpenAI documents it; "ignored" accepted and type-checked with no
# effect (docs/api.md says why each is harmless); "partly" the values docs/api.md lists are served and any
# other is a 400 naming the field; "400" refused whenever it is set. docs/api.md's table carries the same
# status per field, and tests/test_request_fields.py checks the SDK's fields, this table and the docs agree.
OPENAI_FIELDS: dict[str, str] = {
    "messages": "yes",
    "model": "yes",
    "audio": "yes",
    "frequency_penalty": "yes",
    "presence_penalty": "yes",
    "logit_bias": "yes",
    "logprobs": "yes",
    "top_logprobs": "yes",
    "max_completion_tokens": "yes",
    "max_tokens": "yes",
    "modalities": "yes",
    "n": "partly",
    "parallel_tool_calls": "yes",
    "response_format": "yes",
    "seed": "yes",
    "stop": "yes",
    "stream": "yes",
    "stream_options": "yes",
    "temperature": "yes",
    "top_p": "yes",
    "tool_choice": "yes",
    "tools": "yes",
    "user": "ignored",
    "safety_identifier": "ignored",
    "prompt_cache_key": "ignored",
    "metadata": "ignored",
    "prediction": "ignored",
    "store": "partly",
    "service_tier": "partly",
    "reasoning_effort": "partly",
    "verbosity": "partly",
    "prompt_cache_retention": "partly",
    "prompt_cache_options": "partly",
    "functions": "400",
    "function_call": "400",
    "web_search_options": "400",
    "moderation": "400",
}
# vLLM SamplingParams keys that have no meaning for this model's stages; accepted and ignored so
# vLLM-Omni clients that send them keep working.
IGNORED_SAMPLING_KEYS = frozenset(
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

Name = Annotated[str, Field(pattern=NAME_PATTERN, description="1-64 of a-z, A-Z, 0-9, '_', '-'")]
NonEmptyStr = Annotated[str, Field(min_length=1)]


def fail(code: str, message: str, *suffix: str | int) -> PydanticCustomError:
    """An error of reason ``code`` at the validator's location plus ``suffix`` (see the module doc)."""
    return PydanticCustomError(code, message, {"loc_suffix": suffix} if suffix else None)


def _kind(value: Any) -> str:
    """The JSON kind of ``value`` as a tag: ``#str``, ``#list``, ``#dict`` or ``#other``."""
    if isinstance(value, str):
        return "#str"
    if isinstance(value, list):
        return "#list"
    return "#dict" if isinstance(value, dict) else "#other"


def _by_kind(message: str) -> Discriminator:
    """Choose a union member by JSON kind; a kind with no member is ``invalid_type`` with ``message``."""
    return Discriminator(_kind, custom_error_type="invalid_type", custom_error_message=message)


class _Model(BaseModel):
    """Strict types, unknown keys ignored (OpenAI's clients send fields this server has no use for)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, populate_by_name=False)


# ---------------------------------------------------------------------------------------- content parts


class MediaURL(_Model):
    url: NonEmptyStr = Field(description="data: URL, file:// under the allowed root, or http(s) when enabled")


MediaRef = Annotated[
    Annotated[MediaURL, Tag("#dict")] | Annotated[NonEmptyStr, Tag("#str")],
    _by_kind("must be an object with a 'url' or a URL string"),
]


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ImageURLPart(_Model):
    type: Literal["image_url"]
    image_url: MediaRef


class InputAudio(_Model):
    data: str = Field(description="base64 audio file (wav, flac, mp3, ogg, ...) or a data: URL")
    format: str | None = None


class InputAudioPart(_Model):
    type: Literal["input_audio"]
    input_audio: InputAudio


class AudioURLPart(_Model):
    type: Literal["audio_url"]
    audio_url: MediaRef


class VideoURLPart(_Model):
    type: Literal["video_url"]
    video_url: MediaRef


class _BadPartType(_Model):
    """Where a part whose ``type`` is missing or unknown goes: the error names ``type`` and its values."""

    type: Literal["text", "image_url", "input_audio", "audio_url", "video_url"]


class _MediaInTextOnly(_Model):
    """Where a media part of a non-user message goes: always refused at the part."""

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        raise fail(
            "invalid_value", "only user messages may carry images, audio or video; this one may hold text"
        )


def _part_tag(value: Any) -> str | None:
    if isinstance(value, str):
        return "#str"
    if not isinstance(value, dict):
        return None
    ptype = value.get("type")
    return f"#{ptype}" if ptype in PART_TYPES else "#badtype"


def _text_part_tag(value: Any) -> str | None:
    tag = _part_tag(value)
    return "#media" if tag not in (None, "#str", "#text", "#badtype") else tag


_PART_ERROR = "a content part must be a string or an object with a 'type'"

UserPart = Annotated[
    Annotated[str, Tag("#str")]
    | Annotated[TextPart, Tag("#text")]
    | Annotated[ImageURLPart, Tag("#image_url")]
    | Annotated[InputAudioPart, Tag("#input_audio")]
    | Annotated[AudioURLPart, Tag("#audio_url")]
    | Annotated[VideoURLPart, Tag("#video_url")]
    | Annotated[SkipJsonSchema[_BadPartType], Tag("#badtype")],
    Discriminator(_part_tag, custom_error_type="invalid_type", custom_error_message=_PART_ERROR),
]
TextOnlyPart = Annotated[
    Annotated[str, Tag("#str")]
    | Annotated[TextPart, Tag("#text")]
    | Annotated[SkipJsonSchema[_BadPartType], Tag("#badtype")]
    | Annotated[SkipJsonSchema[_MediaInTextOnly], Tag("#media")],
    Discriminator(_text_part_tag, custom_error_type="invalid_type", custom_error_message=_PART_ERROR),
]


def _content_tag(value: Any) -> str:
    if value is None:
        return "#null"
    return _kind(value)


class _Missing(_Model):
    """Where an explicit ``null`` goes for a required content: refused as missing."""

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        raise fail("missing_required_parameter", "is required (a string or a list of content parts)")


_CONTENT_ERROR = "must be a string or a list of content parts"
UserContent = Annotated[
    Annotated[str, Tag("#str")]
    | Annotated[list[UserPart], Tag("#list")]
    | Annotated[SkipJsonSchema[_Missing], Tag("#null")],
    Discriminator(_content_tag, custom_error_type="invalid_type", custom_error_message=_CONTENT_ERROR),
]
TextContent = Annotated[
    Annotated[str, Tag("#str")]
    | Annotated[list[TextOnlyPart], Tag("#list")]
    | Annotated[SkipJsonSchema[_Missing], Tag("#null")],
    Discriminator(_content_tag, custom_error_type="invalid_type", custom_error_message=_CONTENT_ERROR),
]
OptionalTextContent = Annotated[
    Annotated[str, Tag("#str")] | Annotated[list[TextOnlyPart], Tag("#list")],
    _by_kind(_CONTENT_ERROR),
]


# --------------------------------------------------------------------------------------------- messages


class ToolCallFunction(_Model):
    name: Name
    arguments: str = Field(description="the call's arguments as JSON text")


class ToolCallModel(_Model):
    id: NonEmptyStr
    type: Literal["function"] = "function"
    function: ToolCallFunction


class SystemMessage(_Model):
    role: Literal["system"]
    content: TextContent
    name: str | None = None


class DeveloperMessage(_Model):
    role: Literal["developer"]
    content: TextContent
    name: str | None = None


class UserMessage(_Model):
    role: Literal["user"]
    content: UserContent = Field(description="only user messages may carry media")
    name: str | None = None


class AudioRef(_Model):
    id: str


class AssistantMessage(_Model):
    role: Literal["assistant"]
    content: OptionalTextContent | None = Field(None, description="may be omitted when tool_calls are given")
    name: str | None = None
    tool_calls: list[ToolCallModel] | None = None
    refusal: str | None = Field(None, description="an earlier refusal's text: not rendered")
    audio: AudioRef | None = Field(None, description="an earlier audio answer: needs its words in content")
    function_call: SkipJsonSchema[Any] = None

    @model_validator(mode="after")
    def _no_legacy_or_lost_audio(self) -> AssistantMessage:
        if self.function_call is not None:
            raise fail(
                "unsupported_parameter",
                "is not supported (the deprecated function API); send 'tool_calls'",
                "function_call",
            )
        if self.audio is not None and self.content is None and not self.tool_calls:
            raise fail(
                "unsupported_value",
                "this server keeps no audio answers to refer to by id; send their transcript as 'content'",
                "audio",
            )
        return self


class ToolMessage(_Model):
    role: Literal["tool"]
    tool_call_id: str = Field(description="the id of an earlier assistant tool call")
    content: TextContent
    name: str | None = None


class _BadRole(_Model):
    """Where a message whose ``role`` is missing or unknown goes: the error names ``role`` and its values."""

    role: Literal["system", "developer", "user", "assistant", "tool"]


def _role_tag(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    role = value.get("role")
    return f"#{role}" if role in ROLES else "#badrole"


AnyMessage = (
    SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage
)  # what a validated message is
ChatMessage = Annotated[
    Annotated[SystemMessage, Tag("#system")]
    | Annotated[DeveloperMessage, Tag("#developer")]
    | Annotated[UserMessage, Tag("#user")]
    | Annotated[AssistantMessage, Tag("#assistant")]
    | Annotated[ToolMessage, Tag("#tool")]
    | Annotated[SkipJsonSchema[_BadRole], Tag("#badrole")],
    Discriminator(
        _role_tag, custom_error_type="invalid_type", custom_error_message="must be an object with a 'role'"
    ),
]


# ---------------------------------------------------------------------------------- tools, output shape


class FunctionDef(_Model):
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of the arguments")
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else check_json_schema(value)


class ToolDef(_Model):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceName(_Model):
    name: str


class ToolChoiceFunction(_Model):
    type: Literal["function"]
    function: ToolChoiceName


ToolChoiceField = Annotated[
    Annotated[Literal["auto", "none", "required"], Tag("#str")] | Annotated[ToolChoiceFunction, Tag("#dict")],
    _by_kind("must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}"),
]


class JSONSchemaSpec(_Model):
    name: Name
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a valid JSON Schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else check_json_schema(value)


class TextFormat(_Model):
    type: Literal["text"]


class JSONObjectFormat(_Model):
    type: Literal["json_object"]


class JSONSchemaFormat(_Model):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


class _BadFormatType(_Model):
    type: Literal["text", "json_object", "json_schema"]


def _format_tag(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    ftype = value.get("type")
    return f"#{ftype}" if ftype in ("text", "json_object", "json_schema") else "#badtype"


ResponseFormatField = Annotated[
    Annotated[TextFormat, Tag("#text")]
    | Annotated[JSONObjectFormat, Tag("#json_object")]
    | Annotated[JSONSchemaFormat, Tag("#json_schema")]
    | Annotated[SkipJsonSchema[_BadFormatType], Tag("#badtype")],
    Discriminator(_format_tag, custom_error_type="invalid_type", custom_error_message="must be an object"),
]


class AudioOutput(_Model):
    """OpenAI's ``audio`` output object."""

    format: (
        Annotated[str, WithJsonSchema({"enum": ["wav", "pcm", "pcm16", "flac", "mp3", "opus"]})] | None
    ) = None
    voice: Annotated[
        NonEmptyStr,
        WithJsonSchema(
            {"anyOf": [{"type": "string"}, {"type": "object", "properties": {"id": {"type": "string"}}}]}
        ),
    ] = "default"

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_id(cls, value: Any) -> Any:
        """OpenAI's custom-voice reference ``{"id": name}`` names a voice as the plain string does."""
        if isinstance(value, dict) and set(value) == {"id"}:
            return value["id"]
        return value

    @field_validator("format")
    @classmethod
    def _format(cls, value: str | None) -> str | None:
        if value is None:
            return None
        fmt = normalize_format(value)
        if fmt is None or ("pcm16" if fmt == "pcm" else fmt) not in OPENAI_AUDIO_FORMATS:
            raise fail(
                "invalid_value",
                f"unsupported audio format {value[:40]!r}; supported: {list(OPENAI_AUDIO_FORMATS)}",
            )
        return fmt


class StreamOptions(_Model):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None
    include_obfuscation: bool | None = Field(
        None, description="only false: chunks carry no obfuscation field"
    )

    @field_validator("include_obfuscation")
    @classmethod
    def _no_obfuscation(cls, value: bool | None) -> bool | None:
        if value:
            raise fail(
                "unsupported_value", "only false is supported: stream chunks carry no obfuscation padding"
            )
        return value


class PromptCacheOptions(_Model):
    mode: str | None = Field(None, description="only 'implicit': the prefix cache is automatic")
    ttl: SkipJsonSchema[str | None] = None

    @field_validator("mode")
    @classmethod
    def _implicit(cls, value: str | None) -> str | None:
        if value not in (None, "implicit"):
            raise fail(
                "unsupported_value",
                "only 'implicit' is supported: the thinker's prefix cache finds shared prefixes by itself "
                "(explicit breakpoints are not supported)",
            )
        return value

    @field_validator("ttl")
    @classmethod
    def _no_ttl(cls, value: str | None) -> str | None:
        if value is not None:
            raise fail(
                "unsupported_parameter",
                "is not supported: the prefix cache keeps entries until its memory is needed and promises "
                "no lifetime",
            )
        return value


class Prediction(_Model):
    type: Literal["content"]
    content: OptionalTextContent


class ChatTemplateKwargs(_Model):
    use_tts_template: bool | None = None
    enable_thinking: bool | None = None


StopField = Annotated[
    Annotated[NonEmptyStr, Tag("#str")]
    | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_STOP), Tag("#list")],
    _by_kind("must be a string or a list of strings"),
]


# ------------------------------------------------------------------------------------- stage sampling


class _StageSampling(_Model):
    """One stage's entry of ``sampling_params_list``: its keys only (vLLM's ignored ones dropped)."""

    model_config = ConfigDict(json_schema_extra={"additionalProperties": False})

    _aliases: ClassVar[dict[str, str]] = {}

    temperature: NonNegativeFloat32 | None = None
    top_p: NonNegativeFloat32 | None = None
    repetition_penalty: NonNegativeFloat32 | None = None
    top_k: TopK | None = None
    seed: Seed | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # the model's own type check refuses it
        allowed = set(cls.model_fields)
        out = {}
        for key, value in data.items():
            if key in allowed:
                out[key] = value
            elif key not in IGNORED_SAMPLING_KEYS:
                stage = cls.__name__.removesuffix("Sampling").lower()
                shown = sorted(allowed - set(cls._aliases))
                raise fail("invalid_value", f"is not a {stage} sampling parameter (allowed: {shown})", key)
        return out

    def given(self) -> dict[str, Any]:
        """The keys set to a value, under the stage's names (``top_k`` -1, vLLM's "disabled", as 0)."""
        out: dict[str, Any] = {}
        for key, value in self.model_dump(exclude_none=True).items():
            out[self._aliases.get(key, key)] = 0 if (key == "top_k" and value == -1) else value
        return out


class ThinkerSampling(_StageSampling):
    max_tokens: UInt32 | None = None
    min_tokens: UInt32 | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None


class TalkerSampling(_StageSampling):
    # vLLM's names for the talker's frame budgets
    _aliases: ClassVar[dict[str, str]] = {"max_tokens": "max_new_frames", "min_tokens": "min_new_frames"}

    max_tokens: UInt32 | None = None
    min_tokens: UInt32 | None = None
    min_new_frames: UInt32 | None = None
    max_new_frames: UInt32 | None = None
    fixed_frames: UInt32 | None = None


def relay(exc: ValidationError, *prefix: str | int) -> PydanticCustomError:
    """The first error of a nested validation, re-raised below ``prefix`` of the current location."""
    err = exc.errors(include_url=False)[0]
    code, message = error_code_and_message(err)
    return fail(code, message, *prefix, *error_loc(err))


# ------------------------------------------------------------------------------------------- the body

# Refined by gateway/openai/openapi_schema.py with each stage's own schema per position.
STAGES_SCHEMA: dict[str, Any] = {
    "type": "array",
    "maxItems": 3,
    "items": {"anyOf": [{"type": "object"}, {"type": "null"}]},
}


class ChatCompletionRequest(_Model):
    """``POST /v1/chat/completions`` (docs/protocol.md, Chat request; docs/api.md, every field): OpenAI's
    fields plus the vLLM / vLLM-Omni extensions (``sampling_params_list``, ``ref_audio``,
    ``chat_template_kwargs``, ``return_stage_metrics``, ``top_k``, ...). No other top-level key is taken.

    Validation context: ``served_model_name`` (another ``model`` is a 404) and ``max_model_len`` (token
    budgets over the whole thinker context are refused; None: unchecked).
    """

    # The published schema says what the validator does: no other top-level key.
    model_config = ConfigDict(**_Model.model_config, json_schema_extra={"additionalProperties": False})

    # an explicit null is refused (below) and not offered by the schema
    model: Annotated[str | None, WithJsonSchema({"type": "string"})] = Field(
        None, description="must be the served model name"
    )
    messages: list[ChatMessage] = Field(
        min_length=1,
        description="at least one user message",
        json_schema_extra={"contains": {"properties": {"role": {"const": "user"}}, "required": ["role"]}},
    )
    modalities: list[Literal["text", "audio"]] | None = Field(
        None, min_length=1, description="default: the server's default output modalities"
    )
    audio: AudioOutput | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    ref_audio: str | None = Field(None, description="reference voice URI (data:, file://, http(s))")
    extra_body: Any = Field(None, description="may carry ref_audio")
    n: Annotated[PositiveUInt32, WithJsonSchema({"type": "integer", "const": 1})] | None = Field(
        None, description="only 1 is supported"
    )
    functions: Any = Field(None, description="the deprecated tool API: not supported, use tools")
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoiceField | None = Field(
        None, description="a function choice must name a declared tool; auto/required need tools"
    )
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="needs logprobs: true")
    max_tokens: PositiveUInt32 | None = Field(None, description="at most the thinker context")
    max_completion_tokens: PositiveUInt32 | None = Field(None, description="the newer name of max_tokens")
    temperature: Temperature | None = None
    top_p: TopP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    min_tokens: UInt32 | None = None
    stop_token_ids: list[TokenId] | None = Field(
        None, description="more token ids that end the answer (vLLM)"
    )
    ignore_eos: bool | None = Field(None, description="generate max_tokens whatever the stop ids (vLLM)")
    sampling_params_list: Annotated[list[Any], Field(max_length=3), WithJsonSchema(STAGES_SCHEMA)] | None = (
        Field(None, description="per-stage sampling: [thinker, talker(, code2wav)]")
    )
    return_stage_metrics: bool | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormatField | None = None
    stop: StopField | None = Field(None, description=f"a string or 1 to {MAX_STOP} non-empty strings")
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0), FINITE32]] | None = Field(
        None,
        description=f"token id (a decimal string) -> bias in [-100, 100], at most {MAX_LOGIT_BIAS} entries",
    )
    user: str | None = Field(None, description="accepted, no effect")
    safety_identifier: Annotated[str, Field(max_length=128)] | None = Field(
        None, description="accepted, no effect"
    )
    prompt_cache_key: str | None = Field(
        None, description="accepted, no effect: the prefix cache is automatic"
    )
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(
        None, description=f"at most {MAX_METADATA} pairs; nothing is stored, so it has no effect"
    )
    prediction: Prediction | None = Field(None, description="accepted, no effect on the output")
    store: bool | None = Field(None, description="only false: this server stores no completions")
    service_tier: str | None = Field(None, description="'auto' or 'default' (the one tier)")
    reasoning_effort: str | None = Field(
        None, description="only 'none'; the thinking mode is chat_template_kwargs.enable_thinking"
    )
    verbosity: str | None = Field(None, description="only 'medium' (the model's own length)")
    prompt_cache_retention: str | None = Field(None, description="only 'in_memory'")
    prompt_cache_options: PromptCacheOptions | None = None
    function_call: SkipJsonSchema[Any] = None
    web_search_options: SkipJsonSchema[Any] = None
    moderation: SkipJsonSchema[Any] = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        """An unknown top-level key is refused (OpenAI's ``unknown_parameter``), never dropped unseen."""
        if isinstance(data, dict):
            for key in data:
                if key not in _BODY_KEYS:
                    shown = key if len(key) <= 80 else key[:77] + "..."
                    raise fail(
                        "unknown_parameter",
                        "is not a parameter of this endpoint (docs/api.md lists every field it takes)",
                        shown,
                    )
        return data

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        if len(value) > MAX_LOGIT_BIAS:
            raise fail("invalid_value", f"takes at most {MAX_LOGIT_BIAS} token ids, got {len(value)}")
        for key in value:
            if not (key.isascii() and key.isdigit()) or int(key) > INT32_MAX:
                raise fail("invalid_value", "keys must be token ids: decimal integers", key[:80])
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None:
            if len(value) > MAX_METADATA:
                raise fail("invalid_value", f"takes at most {MAX_METADATA} key-value pairs")
            for key in value:
                if len(key) > 64:
                    raise fail("invalid_value", "keys are at most 64 characters", key[:80])
        return value

    @field_validator("store")
    @classmethod
    def _no_store(cls, value: bool | None) -> bool | None:
        if value:
            raise fail("unsupported_value", "only false is supported: this server stores no completions")
        return value

    @field_validator("service_tier")
    @classmethod
    def _one_tier(cls, value: str | None) -> str | None:
        if value not in (None, "auto", "default"):
            raise fail(
                "unsupported_value", f"{value[:40]!r} is not served: this server has one tier, 'default'"
            )
        return value

    @field_validator("reasoning_effort")
    @classmethod
    def _no_reasoning_levels(cls, value: str | None) -> str | None:
        if value not in (None, "none"):
            raise fail(
                "unsupported_value",
                f"{value[:40]!r} is not supported: only 'none'; the model's thinking mode is switched by "
                "chat_template_kwargs.enable_thinking and has no effort levels",
            )
        return value

    @field_validator("verbosity")
    @classmethod
    def _default_verbosity(cls, value: str | None) -> str | None:
        if value not in (None, "medium"):
            raise fail("unsupported_value", f"{value[:40]!r} is not supported: only 'medium' (the default)")
        return value

    @field_validator("prompt_cache_retention")
    @classmethod
    def _in_memory(cls, value: str | None) -> str | None:
        if value not in (None, "in_memory"):
            raise fail(
                "unsupported_value",
                f"{value[:40]!r} is not supported: only 'in_memory' (the prefix cache lives in the thinker's memory)",
            )
        return value

    @field_validator("function_call", "web_search_options", "moderation")
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise fail("unsupported_parameter", _REFUSED[str(info.field_name)])
        return value

    @field_validator("model")
    @classmethod
    def _served(cls, value: str | None, info: ValidationInfo) -> str | None:
        served = (info.context or {}).get("served_model_name")
        if value is None:
            raise fail(
                "missing_required_parameter", "must be a string naming the served model (or be left out)"
            )
        if served is not None and value != served:
            raise fail("model_not_found", model_not_found_message(value, served))
        return value

    @field_validator("messages")
    @classmethod
    def _conversation(cls, messages: list[AnyMessage]) -> list[AnyMessage]:
        """A tool message answers an earlier assistant call; someone must speak as the user."""
        call_ids: set[str] = set()
        for i, msg in enumerate(messages):
            if isinstance(msg, ToolMessage) and msg.tool_call_id not in call_ids:
                raise fail(
                    "invalid_value",
                    f"{msg.tool_call_id[:80]!r} answers no earlier assistant tool call",
                    i,
                    "tool_call_id",
                )
            if isinstance(msg, AssistantMessage) and msg.tool_calls:
                call_ids.update(c.id for c in msg.tool_calls)
        if not any(isinstance(m, UserMessage) for m in messages):
            raise fail("invalid_value", "must contain at least one user message")
        return messages

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise fail("unsupported_value", "only n=1 is supported")
        return value

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, value: Any) -> Any:
        if value:
            raise fail("unsupported_parameter", "is not supported (the deprecated tool API); use 'tools'")
        return None

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, tools: list[ToolDef] | None) -> list[ToolDef] | None:
        seen: set[str] = set()
        for i, tool in enumerate(tools or []):
            if tool.function.name in seen:
                raise fail(
                    "invalid_value",
                    f"the function {tool.function.name!r} is declared twice",
                    i,
                    "function",
                    "name",
                )
            seen.add(tool.function.name)
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_matches_tools(cls, value: Any, info: ValidationInfo) -> Any:
        if "tools" not in info.data:
            return value  # the tools are invalid; that error is reported
        names = {t.function.name for t in info.data["tools"] or []}
        if isinstance(value, str):
            if value != "none" and not names:
                raise fail("invalid_value", f"{value!r} needs 'tools'")
        elif isinstance(value, ToolChoiceFunction) and value.function.name not in names:
            raise fail(
                "invalid_value",
                f"names the function {value.function.name[:80]!r}, which 'tools' does not declare",
            )
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise fail("invalid_value", "needs 'logprobs': true")
        return value

    @field_validator("max_completion_tokens")
    @classmethod
    def _alias_agrees(cls, value: int | None, info: ValidationInfo) -> int | None:
        legacy = info.data.get("max_tokens")
        if value is not None and legacy is not None and legacy != value:
            raise fail(
                "invalid_value",
                f"{value}, but its older alias 'max_tokens' is {legacy}; send one of them, or the same value in both",
            )
        return value

    @field_validator("sampling_params_list")
    @classmethod
    def _stages(cls, value: list[Any] | None) -> list[Any] | None:
        """Entry 0 is the thinker's sampling, entry 1 the talker's (code2wav's, entry 2, has none)."""
        if value is None:
            return None
        out: list[Any] = list(value)
        for i, model in enumerate((ThinkerSampling, TalkerSampling)[: len(value)]):
            if value[i] is None:
                continue
            try:
                out[i] = model.model_validate(value[i])
            except ValidationError as exc:
                raise relay(exc, i) from None
        return out

    @model_validator(mode="after")
    def _after(self, info: ValidationInfo) -> ChatCompletionRequest:
        if (
            self.reasoning_effort == "none"
            and self.chat_template_kwargs
            and self.chat_template_kwargs.enable_thinking
        ):
            raise fail(
                "invalid_value",
                "'none' contradicts chat_template_kwargs.enable_thinking: true; send one of them",
                "reasoning_effort",
            )
        if self.ref_audio is None and isinstance(self.extra_body, dict):
            ref = self.extra_body.get("ref_audio")
            if ref is not None and not isinstance(ref, str):
                raise fail("invalid_type", "must be a URI string", "ref_audio")
        max_model_len = (info.context or {}).get("max_model_len")
        if max_model_len is not None:
            thinker = self.thinker_sampling()
            for key in ("max_tokens", "min_tokens"):
                budget = thinker.get(key)
                if budget is not None and budget > max_model_len:
                    raise fail(
                        "invalid_value",
                        f"{budget} is too large: this model's context holds at most {max_model_len} tokens",
                        key,
                    )
        return self

    def thinker_sampling(self) -> dict[str, Any]:
        """The thinker's sampling: the top-level OpenAI keys, then ``sampling_params_list[0]`` over them."""
        out: dict[str, Any] = {}
        budget = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if budget is not None:
            out["max_tokens"] = budget
        for key in (
            "temperature",
            "top_p",
            "repetition_penalty",
            "top_k",
            "seed",
            "min_tokens",
            "stop_token_ids",
            "ignore_eos",
        ):
            value = getattr(self, key)
            if value is not None:
                out[key] = 0 if (key == "top_k" and value == -1) else value
        stage = self._stage(0)
        if stage is not None:
            out.update(stage.given())
        if out.get("top_p") == 0:
            # OpenAI takes top_p in [0, 1]; the nucleus of p -> 0 is the most likely token alone, which the
            # thinker (top_p in (0, 1]) draws as top_k = 1.
            del out["top_p"]
            out["top_k"] = 1
        return out

    def talker_sampling(self) -> dict[str, Any]:
        """``sampling_params_list[1]`` under the talker's names."""
        stage = self._stage(1)
        return {} if stage is None else stage.given()

    def _stage(self, i: int) -> _StageSampling | None:
        spl = self.sampling_params_list or []
        entry = spl[i] if len(spl) > i else None
        return entry if isinstance(entry, _StageSampling) else None

    def extra_ref_audio(self) -> str | None:
        """``ref_audio``, or the one in ``extra_body`` when the top level has none."""
        if self.ref_audio is None and isinstance(self.extra_body, dict):
            ref = self.extra_body.get("ref_audio")
            return ref if isinstance(ref, str) else None
        return self.ref_audio


# Why each always-refused field is refused (the 400's message).
_REFUSED = {
    "function_call": "is not supported (the deprecated function API); use 'tool_choice'",
    "web_search_options": "is not supported: this server does not search the web",
    "moderation": "is not supported: this server runs no moderation model",
}
# Every top-level key the body may carry (by alias: ``response_format.json_schema.schema`` is nested).
_BODY_KEYS = frozenset(ChatCompletionRequest.model_fields)


def check_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` if it is a valid JSON Schema (checked against its own metaschema)."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise fail(
            "invalid_value", f"is not a valid JSON Schema: {exc.message[:200]} (at '/{where}')"
        ) from None
    except (TypeError, AttributeError, ValueError) as exc:  # e.g. a "$schema" that is not a string
        raise fail("invalid_value", f"is not a valid JSON Schema: {type(exc).__name__}") from None
    return schema


# ---------------------------------------------------------------------------------- errors to OpenAI's


def error_loc(err: Any) -> tuple[str | int, ...]:
    """A pydantic error's location without discriminator tags, plus its ``loc_suffix``."""
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("#")))
    ctx = err.get("ctx") or {}
    return loc + tuple(ctx.get("loc_suffix", ()))


def error_path(loc: tuple[str | int, ...]) -> str | None:
    """``("tools", 0, "function", "name")`` → ``tools[0].function.name``."""
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


_OWN_CODES = frozenset(
    {
        "invalid_value",
        "invalid_type",
        "missing_required_parameter",
        "unsupported_value",
        "unsupported_parameter",
        "unknown_parameter",
        "model_not_found",
    }
)


# pydantic's wording of a type that a JSON client knows under another name.
_PLAIN = {"a valid dictionary": "an object", "a valid list": "a list", "a valid number": "a number"}
_PYDANTIC_WORDING = re.compile(r"a valid dictionary(?: or instance of \w+)?|a valid list|a valid number")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe_error(err: Any, loc: tuple[str | int, ...]) -> tuple[str | None, str, str]:
    """``(param, code, message)`` of one pydantic error found at ``loc``: the JSON path, OpenAI's reason
    code and a message that names the path first (``'stop': list should have at most 4 items...``).
    Every route's refusals are worded this way (the chat body's and FastAPI's own validation)."""
    param = error_path(loc)
    code, message = error_code_and_message(err)
    return param, code, (f"'{param}': {message}" if param else message)


def error_code_and_message(err: Any) -> tuple[str, str]:
    """OpenAI's reason code for a pydantic error, and its message without the location."""
    etype = str(err["type"])
    msg = str(err["msg"])
    if etype in _OWN_CODES:
        return etype, msg
    if etype == "missing":
        return "missing_required_parameter", "is required"
    msg = _PYDANTIC_WORDING.sub(lambda m: _PLAIN[m.group(0).split(" or ")[0]], msg[:1].lower() + msg[1:])
    if etype.endswith("_type") or etype == "literal_error" and not isinstance(err.get("input"), str):
        got = err.get("input")
        kind = "a boolean" if isinstance(got, bool) else "null" if got is None else type(got).__name__
        return ("invalid_type" if etype.endswith("_type") else "invalid_value"), f"{msg}, got {kind}"
    return "invalid_value", f"{msg}, got {_show(err.get('input'))}"
