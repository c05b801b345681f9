from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StreamMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STREAM_MODE_UNSPECIFIED: _ClassVar[StreamMode]
    STREAM_MODE_TURN: _ClassVar[StreamMode]
    STREAM_MODE_DUPLEX: _ClassVar[StreamMode]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]

class PcmFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PCM_FORMAT_UNSPECIFIED: _ClassVar[PcmFormat]
    PCM_FORMAT_S16LE: _ClassVar[PcmFormat]
    PCM_FORMAT_F32LE: _ClassVar[PcmFormat]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_ARGUMENT: _ClassVar[ErrorCode]
    ERROR_CODE_CONTEXT_LENGTH_EXCEEDED: _ClassVar[ErrorCode]
    ERROR_CODE_RESOURCE_EXHAUSTED: _ClassVar[ErrorCode]
    ERROR_CODE_UNAVAILABLE: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
    ERROR_CODE_CANCELLED: _ClassVar[ErrorCode]
    ERROR_CODE_DEADLINE_EXCEEDED: _ClassVar[ErrorCode]
    ERROR_CODE_OUT_OF_ORDER: _ClassVar[ErrorCode]
    ERROR_CODE_UNSUPPORTED_MEDIA: _ClassVar[ErrorCode]
    ERROR_CODE_BAD_REFERENCE_AUDIO: _ClassVar[ErrorCode]
    ERROR_CODE_FAILED_PRECONDITION: _ClassVar[ErrorCode]
STREAM_MODE_UNSPECIFIED: StreamMode
STREAM_MODE_TURN: StreamMode
STREAM_MODE_DUPLEX: StreamMode
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
DTYPE_INT64: DType
DTYPE_INT32: DType
PCM_FORMAT_UNSPECIFIED: PcmFormat
PCM_FORMAT_S16LE: PcmFormat
PCM_FORMAT_F32LE: PcmFormat
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_INVALID_ARGUMENT: ErrorCode
ERROR_CODE_CONTEXT_LENGTH_EXCEEDED: ErrorCode
ERROR_CODE_RESOURCE_EXHAUSTED: ErrorCode
ERROR_CODE_UNAVAILABLE: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode
ERROR_CODE_CANCELLED: ErrorCode
ERROR_CODE_DEADLINE_EXCEEDED: ErrorCode
ERROR_CODE_OUT_OF_ORDER: ErrorCode
ERROR_CODE_UNSUPPORTED_MEDIA: ErrorCode
ERROR_CODE_BAD_REFERENCE_AUDIO: ErrorCode
ERROR_CODE_FAILED_PRECONDITION: ErrorCode

class Identity(_message.Message):
    __slots__ = ("request_id", "session_id", "epoch", "turn_id", "unit_seq", "chunk_seq")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    UNIT_SEQ_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SEQ_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    epoch: int
    turn_id: int
    unit_seq: int
    chunk_seq: int
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., turn_id: _Optional[int] = ..., unit_seq: _Optional[int] = ..., chunk_seq: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Pcm(_message.Message):
    __slots__ = ("sample_rate", "format", "channels", "data")
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    sample_rate: int
    format: PcmFormat
    channels: int
    data: bytes
    def __init__(self, sample_rate: _Optional[int] = ..., format: _Optional[_Union[PcmFormat, str]] = ..., channels: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class Interrupt(_message.Message):
    __slots__ = ("new_epoch", "reason")
    NEW_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    new_epoch: int
    reason: str
    def __init__(self, new_epoch: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Flush(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class End(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Control(_message.Message):
    __slots__ = ("id", "interrupt", "flush", "end")
    ID_FIELD_NUMBER: _ClassVar[int]
    INTERRUPT_FIELD_NUMBER: _ClassVar[int]
    FLUSH_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    id: Identity
    interrupt: Interrupt
    flush: Flush
    end: End
    def __init__(self, id: _Optional[_Union[Identity, _Mapping]] = ..., interrupt: _Optional[_Union[Interrupt, _Mapping]] = ..., flush: _Optional[_Union[Flush, _Mapping]] = ..., end: _Optional[_Union[End, _Mapping]] = ...) -> None: ...

class InterruptAck(_message.Message):
    __slots__ = ("id", "new_epoch", "dropped_items")
    ID_FIELD_NUMBER: _ClassVar[int]
    NEW_EPOCH_FIELD_NUMBER: _ClassVar[int]
    DROPPED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    id: Identity
    new_epoch: int
    dropped_items: int
    def __init__(self, id: _Optional[_Union[Identity, _Mapping]] = ..., new_epoch: _Optional[int] = ..., dropped_items: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("id", "code", "message", "param")
    ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    id: Identity
    code: ErrorCode
    message: str
    param: str
    def __init__(self, id: _Optional[_Union[Identity, _Mapping]] = ..., code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ..., param: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "extra", "cached_tokens")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    extra: _containers.ScalarMap[str, int]
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., extra: _Optional[_Mapping[str, int]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("id", "finish_reason", "usage")
    ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    id: Identity
    finish_reason: str
    usage: Usage
    def __init__(self, id: _Optional[_Union[Identity, _Mapping]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class CodecWindow(_message.Message):
    __slots__ = ("id", "codes", "left_context", "is_last")
    ID_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    LEFT_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_FIELD_NUMBER: _ClassVar[int]
    id: Identity
    codes: _containers.RepeatedScalarFieldContainer[int]
    left_context: int
    is_last: bool
    def __init__(self, id: _Optional[_Union[Identity, _Mapping]] = ..., codes: _Optional[_Iterable[int]] = ..., left_context: _Optional[int] = ..., is_last: _Optional[bool] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageInfo(_message.Message):
    __slots__ = ("stage", "model", "model_version", "protocol_version", "device", "compute_dtype", "capabilities", "limits", "properties")
    class LimitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PropertiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    stage: str
    model: str
    model_version: str
    protocol_version: str
    device: str
    compute_dtype: DType
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    limits: _containers.ScalarMap[str, int]
    properties: _containers.ScalarMap[str, str]
    def __init__(self, stage: _Optional[str] = ..., model: _Optional[str] = ..., model_version: _Optional[str] = ..., protocol_version: _Optional[str] = ..., device: _Optional[str] = ..., compute_dtype: _Optional[_Union[DType, str]] = ..., capabilities: _Optional[_Iterable[str]] = ..., limits: _Optional[_Mapping[str, int]] = ..., properties: _Optional[_Mapping[str, str]] = ...) -> None: ...
