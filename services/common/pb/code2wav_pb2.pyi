from services.common.pb import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Code2WavOpen(_message.Message):
    __slots__ = ("id", "ref_audio", "seed", "output_format", "voice")
    ID_FIELD_NUMBER: _ClassVar[int]
    REF_AUDIO_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    VOICE_FIELD_NUMBER: _ClassVar[int]
    id: _common_pb2.Identity
    ref_audio: _common_pb2.Pcm
    seed: int
    output_format: _common_pb2.PcmFormat
    voice: VoicePrompt
    def __init__(self, id: _Optional[_Union[_common_pb2.Identity, _Mapping]] = ..., ref_audio: _Optional[_Union[_common_pb2.Pcm, _Mapping]] = ..., seed: _Optional[int] = ..., output_format: _Optional[_Union[_common_pb2.PcmFormat, str]] = ..., voice: _Optional[_Union[VoicePrompt, _Mapping]] = ...) -> None: ...

class VoicePrompt(_message.Message):
    __slots__ = ("tokens", "mel", "spk_emb", "digest")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEL_FIELD_NUMBER: _ClassVar[int]
    SPK_EMB_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    tokens: _common_pb2.Tensor
    mel: _common_pb2.Tensor
    spk_emb: _common_pb2.Tensor
    digest: str
    def __init__(self, tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., mel: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., spk_emb: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., digest: _Optional[str] = ...) -> None: ...

class Code2WavVoiceRequest(_message.Message):
    __slots__ = ("ref_audio",)
    REF_AUDIO_FIELD_NUMBER: _ClassVar[int]
    ref_audio: _common_pb2.Pcm
    def __init__(self, ref_audio: _Optional[_Union[_common_pb2.Pcm, _Mapping]] = ...) -> None: ...

class Code2WavRequest(_message.Message):
    __slots__ = ("open", "window", "control")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    open: Code2WavOpen
    window: _common_pb2.CodecWindow
    control: _common_pb2.Control
    def __init__(self, open: _Optional[_Union[Code2WavOpen, _Mapping]] = ..., window: _Optional[_Union[_common_pb2.CodecWindow, _Mapping]] = ..., control: _Optional[_Union[_common_pb2.Control, _Mapping]] = ...) -> None: ...

class AudioChunk(_message.Message):
    __slots__ = ("id", "pcm", "is_last")
    ID_FIELD_NUMBER: _ClassVar[int]
    PCM_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_FIELD_NUMBER: _ClassVar[int]
    id: _common_pb2.Identity
    pcm: _common_pb2.Pcm
    is_last: bool
    def __init__(self, id: _Optional[_Union[_common_pb2.Identity, _Mapping]] = ..., pcm: _Optional[_Union[_common_pb2.Pcm, _Mapping]] = ..., is_last: _Optional[bool] = ...) -> None: ...

class Code2WavResponse(_message.Message):
    __slots__ = ("audio", "done", "error", "interrupt_ack")
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    INTERRUPT_ACK_FIELD_NUMBER: _ClassVar[int]
    audio: AudioChunk
    done: _common_pb2.Done
    error: _common_pb2.Error
    interrupt_ack: _common_pb2.InterruptAck
    def __init__(self, audio: _Optional[_Union[AudioChunk, _Mapping]] = ..., done: _Optional[_Union[_common_pb2.Done, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., interrupt_ack: _Optional[_Union[_common_pb2.InterruptAck, _Mapping]] = ...) -> None: ...
