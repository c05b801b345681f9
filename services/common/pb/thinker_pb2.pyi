from services.common.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UnitDecision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UNIT_DECISION_UNSPECIFIED: _ClassVar[UnitDecision]
    UNIT_DECISION_LISTEN: _ClassVar[UnitDecision]
    UNIT_DECISION_SPEAK: _ClassVar[UnitDecision]
UNIT_DECISION_UNSPECIFIED: UnitDecision
UNIT_DECISION_LISTEN: UnitDecision
UNIT_DECISION_SPEAK: UnitDecision

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "repetition_penalty", "seed", "max_tokens", "min_tokens", "ignore_eos", "stop_token_ids", "presence_penalty", "frequency_penalty", "stop", "logprobs", "top_logprobs", "constraint", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    seed: int
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    presence_penalty: float
    frequency_penalty: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: bool
    top_logprobs: int
    constraint: Constraint
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("kind", "spec", "parallel")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Constraint.Kind]
        KIND_JSON_OBJECT: _ClassVar[Constraint.Kind]
        KIND_JSON_SCHEMA: _ClassVar[Constraint.Kind]
        KIND_TOOL_CALLS: _ClassVar[Constraint.Kind]
    KIND_UNSPECIFIED: Constraint.Kind
    KIND_JSON_OBJECT: Constraint.Kind
    KIND_JSON_SCHEMA: Constraint.Kind
    KIND_TOOL_CALLS: Constraint.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    kind: Constraint.Kind
    spec: str
    parallel: bool
    def __init__(self, kind: _Optional[_Union[Constraint.Kind, str]] = ..., spec: _Optional[str] = ..., parallel: _Optional[bool] = ...) -> None: ...

class ImagePart(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class AudioPart(_message.Message):
    __slots__ = ("pcm",)
    PCM_FIELD_NUMBER: _ClassVar[int]
    pcm: _common_pb2.Pcm
    def __init__(self, pcm: _Optional[_Union[_common_pb2.Pcm, _Mapping]] = ...) -> None: ...

class VideoPart(_message.Message):
    __slots__ = ("frames", "soundtrack")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    SOUNDTRACK_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedScalarFieldContainer[bytes]
    soundtrack: _common_pb2.Pcm
    def __init__(self, frames: _Optional[_Iterable[bytes]] = ..., soundtrack: _Optional[_Union[_common_pb2.Pcm, _Mapping]] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("text", "image", "audio", "video")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: ImagePart
    audio: AudioPart
    video: VideoPart
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[ImagePart, _Mapping]] = ..., audio: _Optional[_Union[AudioPart, _Mapping]] = ..., video: _Optional[_Union[VideoPart, _Mapping]] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: _containers.RepeatedCompositeFieldContainer[ContentPart]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ThinkerOpen(_message.Message):
    __slots__ = ("id", "mode", "messages", "sampling", "use_tts_template", "enable_thinking", "want_speech", "ref_audio", "chunk_tokens", "first_chunk_tokens", "hidden_dtype", "instructions", "force_speak", "force_listen_units", "tools_json", "teacher_text", "voice")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    USE_TTS_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    ENABLE_THINKING_FIELD_NUMBER: _ClassVar[int]
    WANT_SPEECH_FIELD_NUMBER: _ClassVar[int]
    REF_AUDIO_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_DTYPE_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    FORCE_SPEAK_FIELD_NUMBER: _ClassVar[int]
    FORCE_LISTEN_UNITS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TEACHER_TEXT_FIELD_NUMBER: _ClassVar[int]
    VOICE_FIELD_NUMBER: _ClassVar[int]
    id: _common_pb2.Identity
    mode: _common_pb2.StreamMode
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    sampling: SamplingParams
    use_tts_template: bool
    enable_thinking: bool
    want_speech: bool
    ref_audio: _common_pb2.Pcm
    chunk_tokens: int
    first_chunk_tokens: int
    hidden_dtype: _common_pb2.DType
    instructions: str
    force_speak: bool
    force_listen_units: int
    tools_json: _containers.RepeatedScalarFieldContainer[str]
    teacher_text: str
    voice: VoiceEmbedding
    def __init__(self, id: _Optional[_Union[_common_pb2.Identity, _Mapping]] = ..., mode: _Optional[_Union[_common_pb2.StreamMode, str]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., use_tts_template: _Optional[bool] = ..., enable_thinking: _Optional[bool] = ..., want_speech: _Optional[bool] = ..., ref_audio: _Optional[_Union[_common_pb2.Pcm, _Mapping]] = ..., chunk_tokens: _Optional[int] = ..., first_chunk_tokens: _Optional[int] = ..., hidden_dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., instructions: _Optional[str] = ..., force_speak: _Optional[bool] = ..., force_listen_units: _Optional[int] = ..., tools_json: _Optional[_Iterable[str]] = ..., teacher_text: _Optional[str] = ..., voice: _Optional[_Union[VoiceEmbedding, _Mapping]] = ...) -> None: ...

class VoiceEmbedding(_message.Message):
    __slots__ = ("embeds", "digest")
    EMBEDS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    embeds: _common_pb2.Tensor
    digest: str
    def __init__(self, embeds: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., digest: _Optional[str] = ...) -> None: ...

class ThinkerVoiceRequest(_message.Message):
    __slots__ = ("ref_audio",)
    REF_AUDIO_FIELD_NUMBER: _ClassVar[int]
    ref_audio: _common_pb2.Pcm
    def __init__(self, ref_audio: _Optional[_Union[_common_pb2.Pcm, _Mapping]] = ...) -> None: ...

class ThinkerUnit(_message.Message):
    __slots__ = ("id", "audio", "frames", "request_response", "force_listen", "continue_turn", "instructions", "max_output_tokens", "tools_json", "tool_call", "tool_call_forced", "tool_outputs")
    ID_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    FORCE_LISTEN_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_TURN_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FORCED_FIELD_NUMBER: _ClassVar[int]
    TOOL_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    id: _common_pb2.Identity
    audio: _common_pb2.Pcm
    frames: _containers.RepeatedScalarFieldContainer[bytes]
    request_response: bool
    force_listen: bool
    continue_turn: bool
    instructions: str
    max_output_tokens: int
    tools_json: _containers.RepeatedScalarFieldContainer[str]
    tool_call: Constraint
    tool_call_forced: bool
    tool_outputs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[_Union[_common_pb2.Identity, _Mapping]] = ..., audio: _Optional[_Union[_common_pb2.Pcm, _Mapping]] = ..., frames: _Optional[_Iterable[bytes]] = ..., request_response: _Optional[bool] = ..., force_listen: _Optional[bool] = ..., continue_turn: _Optional[bool] = ..., instructions: _Optional[str] = ..., max_output_tokens: _Optional[int] = ..., tools_json: _Optional[_Iterable[str]] = ..., tool_call: _Optional[_Union[Constraint, _Mapping]] = ..., tool_call_forced: _Optional[bool] = ..., tool_outputs: _Optional[_Iterable[str]] = ...) -> None: ...

class ThinkerRequest(_message.Message):
    __slots__ = ("open", "unit", "control")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    open: ThinkerOpen
    unit: ThinkerUnit
    control: _common_pb2.Control
    def __init__(self, open: _Optional[_Union[ThinkerOpen, _Mapping]] = ..., unit: _Optional[_Union[ThinkerUnit, _Mapping]] = ..., control: _Optional[_Union[_common_pb2.Control, _Mapping]] = ...) -> None: ...

class TextDelta(_message.Message):
    __slots__ = ("id", "token_ids", "text", "prompt_tokens", "logprobs")
    ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    id: _common_pb2.Identity
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    prompt_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, id: _Optional[_Union[_common_pb2.Identity, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "token_bytes", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    token_bytes: bytes
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., token_bytes: _Optional[bytes] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "token_bytes", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    token_bytes: bytes
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., token_bytes: _Optional[bytes] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class SpeechChunk(_message.Message):
    __slots__ = ("id", "token_ids", "hidden", "text", "turn_start", "turn_end", "segment_end", "is_last")
    ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TURN_START_FIELD_NUMBER: _ClassVar[int]
    TURN_END_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_END_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_FIELD_NUMBER: _ClassVar[int]
    id: _common_pb2.Identity
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden: _common_pb2.Tensor
    text: str
    turn_start: bool
    turn_end: bool
    segment_end: bool
    is_last: bool
    def __init__(self, id: _Optional[_Union[_common_pb2.Identity, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., hidden: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., text: _Optional[str] = ..., turn_start: _Optional[bool] = ..., turn_end: _Optional[bool] = ..., segment_end: _Optional[bool] = ..., is_last: _Optional[bool] = ...) -> None: ...

class UnitResult(_message.Message):
    __slots__ = ("id", "decision", "transcript", "token_ids", "turn_end", "context_tokens", "context_before", "max_tokens_reached", "tool_call", "tool_call_truncated", "tool_error")
    ID_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TURN_END_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_BEFORE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_REACHED_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    TOOL_ERROR_FIELD_NUMBER: _ClassVar[int]
    id: _common_pb2.Identity
    decision: UnitDecision
    transcript: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    turn_end: bool
    context_tokens: int
    context_before: int
    max_tokens_reached: bool
    tool_call: str
    tool_call_truncated: bool
    tool_error: str
    def __init__(self, id: _Optional[_Union[_common_pb2.Identity, _Mapping]] = ..., decision: _Optional[_Union[UnitDecision, str]] = ..., transcript: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., turn_end: _Optional[bool] = ..., context_tokens: _Optional[int] = ..., context_before: _Optional[int] = ..., max_tokens_reached: _Optional[bool] = ..., tool_call: _Optional[str] = ..., tool_call_truncated: _Optional[bool] = ..., tool_error: _Optional[str] = ...) -> None: ...

class ThinkerResponse(_message.Message):
    __slots__ = ("text", "speech", "unit", "done", "error", "interrupt_ack")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SPEECH_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    INTERRUPT_ACK_FIELD_NUMBER: _ClassVar[int]
    text: TextDelta
    speech: SpeechChunk
    unit: UnitResult
    done: _common_pb2.Done
    error: _common_pb2.Error
    interrupt_ack: _common_pb2.InterruptAck
    def __init__(self, text: _Optional[_Union[TextDelta, _Mapping]] = ..., speech: _Optional[_Union[SpeechChunk, _Mapping]] = ..., unit: _Optional[_Union[UnitResult, _Mapping]] = ..., done: _Optional[_Union[_common_pb2.Done, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., interrupt_ack: _Optional[_Union[_common_pb2.InterruptAck, _Mapping]] = ...) -> None: ...
