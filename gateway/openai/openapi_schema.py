"""The chat request body as an OpenAPI schema, for ``/openapi.json`` (client generators, schema fuzzers).

These pydantic models only *describe* the body (for client generators and the schemathesis fuzz run of
``bench/reliability.py fuzz-http``); requests are validated by
:func:`gateway.openai.protocol.parse_chat_request`, which names the failing field in its error. The bounds
here are the ones that function enforces.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.openai.protocol import INT32_MAX, MAX_STOP, MAX_TOP_LOGPROBS, UINT32_MAX, UINT64_MAX

_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class MediaURL(_Open):
    url: str = Field(
        min_length=1, description="data: URL, file:// under the allowed root, or http(s) when enabled"
    )


class TextPartSchema(_Open):
    type: Literal["text"]
    text: str


class ImageURLPartSchema(_Open):
    type: Literal["image_url"]
    image_url: MediaURL | str


class InputAudioSchema(_Open):
    data: str = Field(description="base64 audio file (wav, flac, mp3, ogg, ...) or a data: URL")
    format: str | None = None


class InputAudioPartSchema(_Open):
    type: Literal["input_audio"]
    input_audio: InputAudioSchema


class AudioURLPartSchema(_Open):
    type: Literal["audio_url"]
    audio_url: MediaURL | str


class VideoURLPartSchema(_Open):
    type: Literal["video_url"]
    video_url: MediaURL | str


ContentPartSchema = Annotated[
    TextPartSchema | ImageURLPartSchema | InputAudioPartSchema | AudioURLPartSchema | VideoURLPartSchema,
    Field(discriminator="type"),
]


class ToolCallFunctionSchema(_Open):
    name: str = Field(pattern=_NAME)
    arguments: str = Field(description="the call's arguments as JSON text")


class ToolCallSchema(_Open):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: ToolCallFunctionSchema


class ChatMessageSchema(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPartSchema | str] | None = Field(
        None, description="only user messages may carry media; only assistant messages may omit it"
    )
    name: str | None = None
    tool_calls: list[ToolCallSchema] | None = Field(None, description="assistant messages only")
    tool_call_id: str | None = Field(
        None, description="tool messages: the id of an earlier assistant tool call (required there)"
    )


class FunctionSchema(_Open):
    name: str = Field(pattern=_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of the arguments")
    strict: bool | None = None


class ToolSchema(_Open):
    type: Literal["function"]
    function: FunctionSchema


class ToolChoiceFunctionName(_Open):
    name: str


class ToolChoiceFunctionSchema(_Open):
    type: Literal["function"]
    function: ToolChoiceFunctionName


class JSONSchemaFormat(_Open):
    name: str = Field(pattern=_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a valid JSON Schema")
    strict: bool | None = None


class ResponseFormatSchema(_Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = Field(None, description="required with type json_schema")


class StreamOptionsSchema(_Open):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class AudioOutputSchema(_Open):
    format: Literal["wav", "pcm", "pcm16", "flac", "mp3", "opus"] | None = None
    voice: str | None = Field(None, min_length=1)


class ChatTemplateKwargsSchema(_Open):
    use_tts_template: bool | None = None
    enable_thinking: bool | None = None


class ChatCompletionRequest(_Open):
    """``POST /v1/chat/completions`` (docs/protocol.md, Chat request): OpenAI fields plus the vLLM-Omni
    extensions."""

    model: str | None = Field(None, description="must be the served model name")
    messages: list[ChatMessageSchema] = Field(min_length=1)
    modalities: list[Literal["text", "audio"]] | None = Field(
        None, min_length=1, description="default: the server's default output (text and audio)"
    )
    audio: AudioOutputSchema | None = None
    stream: bool | None = None
    stream_options: StreamOptionsSchema | None = None
    max_tokens: int | None = Field(None, ge=1, le=UINT32_MAX, description="at most the thinker context")
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    min_tokens: int | None = Field(None, ge=0, le=UINT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    repetition_penalty: float | None = Field(None, ge=0.0, le=10.0)
    seed: int | None = Field(None, ge=0, le=UINT64_MAX)
    n: Literal[1] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stop: str | list[str] | None = Field(None, description=f"a string or 1 to {MAX_STOP} non-empty strings")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="needs logprobs: true")
    tools: list[ToolSchema] | None = None
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceFunctionSchema | None = Field(
        None, description="a function choice must name a declared tool; auto/required need tools"
    )
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormatSchema | None = None
    chat_template_kwargs: ChatTemplateKwargsSchema | None = None
    ref_audio: str | None = Field(None, description="reference voice URI (data:, file://, http(s))")
    sampling_params_list: list[dict[str, Any] | None] | None = Field(
        None, max_length=3, description="per-stage sampling: [thinker, talker(, code2wav)]"
    )
    return_stage_metrics: bool | None = None


def chat_request_openapi() -> tuple[dict[str, Any], dict[str, Any]]:
    """(requestBody object, component schemas it refers to) for the chat route's OpenAPI operation."""
    schema = ChatCompletionRequest.model_json_schema(
        ref_template="#/components/schemas/{model}", by_alias=True
    )
    components = schema.pop("$defs", {})
    components["ChatCompletionRequest"] = schema
    body = {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}}},
    }
    return body, components
