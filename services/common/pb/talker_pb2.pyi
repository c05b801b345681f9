from services.common.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TalkerSampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "repetition_penalty", "seed", "min_new_frames", "max_new_frames", "fixed_frames")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_FRAMES_FIELD_NUMBER: _ClassVar[int]
    FIXED_FRAMES_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    seed: int
    min_new_frames: int
    max_new_frames: int
    fixed_frames: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., min_new_frames: _Optional[int] = ..., max_new_frames: _Optional[int] = ..., fixed_frames: _Optional[int] = ...) -> None: ...

class TalkerOpen(_message.Message):
    __slots__ = ("id", "mode", "sampling", "window_frames", "left_context", "first_window_frames")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FRAMES_FIELD_NUMBER: _ClassVar[int]
    LEFT_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    FIRST_WINDOW_FRAMES_FIELD_NUMBER: _ClassVar[int]
    id: _common_pb2.Identity
    mode: _common_pb2.StreamMode
    sampling: TalkerSampling
    window_frames: int
    left_context: int
    first_window_frames: int
    def __init__(self, id: _Optional[_Union[_common_pb2.Identity, _Mapping]] = ..., mode: _Optional[_Union[_common_pb2.StreamMode, str]] = ..., sampling: _Optional[_Union[TalkerSampling, _Mapping]] = ..., window_frames: _Optional[int] = ..., left_context: _Optional[int] = ..., first_window_frames: _Optional[int] = ...) -> None: ...

class TalkerChunk(_message.Message):
    __slots__ = ("id", "token_ids", "hidden", "turn_end", "is_last")
    ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TURN_END_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_FIELD_NUMBER: _ClassVar[int]
    id: _common_pb2.Identity
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden: _common_pb2.Tensor
    turn_end: bool
    is_last: bool
    def __init__(self, id: _Optional[_Union[_common_pb2.Identity, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., hidden: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., turn_end: _Optional[bool] = ..., is_last: _Optional[bool] = ...) -> None: ...

class TalkerRequest(_message.Message):
    __slots__ = ("open", "chunk", "control")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    open: TalkerOpen
    chunk: TalkerChunk
    control: _common_pb2.Control
    def __init__(self, open: _Optional[_Union[TalkerOpen, _Mapping]] = ..., chunk: _Optional[_Union[TalkerChunk, _Mapping]] = ..., control: _Optional[_Union[_common_pb2.Control, _Mapping]] = ...) -> None: ...

class TalkerResponse(_message.Message):
    __slots__ = ("window", "done", "error", "interrupt_ack")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    INTERRUPT_ACK_FIELD_NUMBER: _ClassVar[int]
    window: _common_pb2.CodecWindow
    done: _common_pb2.Done
    error: _common_pb2.Error
    interrupt_ack: _common_pb2.InterruptAck
    def __init__(self, window: _Optional[_Union[_common_pb2.CodecWindow, _Mapping]] = ..., done: _Optional[_Union[_common_pb2.Done, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., interrupt_ack: _Optional[_Union[_common_pb2.InterruptAck, _Mapping]] = ...) -> None: ...
