"""Scripted stand-ins for the three stage services, to test the gateway's orchestration in isolation.

They speak the real protos on real gRPC servers (sync ``grpc.server`` on loopback, health service
included) but compute nothing: the fake thinker describes what it received and streams numbered tokens
(plus hidden-state chunks when speech is wanted), the fake talker turns each chunk into one codec window,
the fake code2wav turns each window into a 24 kHz sine. Every fake counts its live streams and records
what happened when, so tests can check ordering (the talker opens before the thinker finishes) and
cleanup (live streams return to zero after a client disconnect).
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.pb import (
    code2wav_pb2,
    code2wav_pb2_grpc,
    common_pb2,
    talker_pb2,
    talker_pb2_grpc,
    thinker_pb2,
    thinker_pb2_grpc,
)
from services.common.tensors import pcm_from_float, pcm_to_float

SAMPLES_PER_FRAME = 960  # 24 kHz / 25 Hz


@dataclass
class StageLog:
    """What one fake saw: live stream count, opens, and timestamped events."""

    active: int = 0
    opens: list = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def enter(self, open_msg: object) -> None:
        with self.lock:
            self.active += 1
            self.opens.append(open_msg)
            self.events.append((time.monotonic(), "open"))

    def leave(self) -> None:
        with self.lock:
            self.active -= 1
            self.events.append((time.monotonic(), "close"))

    def mark(self, what: str) -> None:
        with self.lock:
            self.events.append((time.monotonic(), what))

    def first(self, what: str) -> float:
        return next(t for t, e in self.events if e == what)


def describe_part(part: thinker_pb2.ContentPart) -> str:
    kind = part.WhichOneof("kind")
    if kind == "text":
        return "text"
    if kind == "image":
        return f"image({part.image.data[:4].hex()})"
    if kind == "audio":
        samples, rate = pcm_to_float(part.audio.pcm)
        return f"audio({rate}Hz,{samples.size / rate:.2f}s)"
    video = part.video
    sound = f"{video.soundtrack.sample_rate}Hz" if video.HasField("soundtrack") else "none"
    return f"video(frames={len(video.frames)},soundtrack={sound})"


class FakeThinker(thinker_pb2_grpc.ThinkerServiceServicer):
    def __init__(self, log: StageLog) -> None:
        self.log = log
        self.tokens = 6
        self.token_delay_s = 0.0
        self.fail_unavailable_once = False

    def GetInfo(self, request, context):  # noqa: N802
        return common_pb2.StageInfo(stage="thinker", protocol_version="minicpmo.v1")

    def Generate(self, request_iterator, context):  # noqa: N802
        first = next(request_iterator)
        if self.fail_unavailable_once:
            self.fail_unavailable_once = False
            context.abort(grpc.StatusCode.UNAVAILABLE, "replica going away")
        opened = first.open
        self.log.enter(opened)
        try:
            parts = [describe_part(p) for m in opened.messages for p in m.content]
            texts = [p.text for m in opened.messages for p in m.content if p.WhichOneof("kind") == "text"]
            ident = opened.id
            if any("FAIL_INVALID" in t for t in texts):
                yield thinker_pb2.ThinkerResponse(
                    error=common_pb2.Error(id=ident, code=common_pb2.ERROR_CODE_INVALID_ARGUMENT,
                                           message="the fake refuses this prompt", param="messages[0]")
                )
                return
            n = opened.sampling.max_tokens if opened.sampling.HasField("max_tokens") else self.tokens
            n = min(n, self.tokens)
            header = f"[{' '.join(parts)}] "
            yield thinker_pb2.ThinkerResponse(text=thinker_pb2.TextDelta(id=ident, text=header, token_ids=[1]))
            pending: list[int] = []
            for i in range(n):
                if not context.is_active():
                    return
                time.sleep(self.token_delay_s)
                yield thinker_pb2.ThinkerResponse(text=thinker_pb2.TextDelta(id=ident, text=f"t{i} ", token_ids=[100 + i]))
                pending.append(100 + i)
                last = i == n - 1
                if opened.want_speech and (len(pending) == 2 or last):
                    hidden = np.ones((len(pending), 8), dtype=np.float32)
                    tensor = common_pb2.Tensor(dtype=common_pb2.DTYPE_FLOAT32, shape=[len(pending), 8],
                                               data=hidden.tobytes())
                    self.log.mark("speech_chunk")
                    yield thinker_pb2.ThinkerResponse(
                        speech=thinker_pb2.SpeechChunk(id=ident, token_ids=pending, hidden=tensor, is_last=last)
                    )
                    pending = []
            self.log.mark("done")
            usage = common_pb2.Usage(prompt_tokens=7, completion_tokens=n, total_tokens=7 + n)
            yield thinker_pb2.ThinkerResponse(done=common_pb2.Done(id=ident, finish_reason="length", usage=usage))
        finally:
            self.log.leave()


class FakeTalker(talker_pb2_grpc.TalkerServiceServicer):
    def __init__(self, log: StageLog) -> None:
        self.log = log
        self.chunk_ids: list[list[int]] = []

    def GetInfo(self, request, context):  # noqa: N802
        return common_pb2.StageInfo(stage="talker", protocol_version="minicpmo.v1")

    def Generate(self, request_iterator, context):  # noqa: N802
        first = next(request_iterator)
        self.log.enter(first.open)
        try:
            left = first.open.left_context or 3
            for req in request_iterator:
                kind = req.WhichOneof("kind")
                if kind == "chunk":
                    self.chunk_ids.append(list(req.chunk.token_ids))
                    frames = 2 * len(req.chunk.token_ids)
                    yield talker_pb2.TalkerResponse(
                        window=common_pb2.CodecWindow(id=req.chunk.id, codes=[4218] * left + [7] * frames,
                                                      left_context=left, is_last=req.chunk.is_last)
                    )
                    if req.chunk.is_last:
                        break
                elif kind == "control" and req.control.WhichOneof("kind") == "end":
                    break
            yield talker_pb2.TalkerResponse(done=common_pb2.Done(finish_reason="stop"))
        finally:
            self.log.leave()


class FakeCode2Wav(code2wav_pb2_grpc.Code2WavServiceServicer):
    def __init__(self, log: StageLog) -> None:
        self.log = log

    def GetInfo(self, request, context):  # noqa: N802
        return common_pb2.StageInfo(stage="code2wav", protocol_version="minicpmo.v1")

    def Generate(self, request_iterator, context):  # noqa: N802
        first = next(request_iterator)
        self.log.enter(first.open)
        try:
            for req in request_iterator:
                kind = req.WhichOneof("kind")
                if kind == "window":
                    w = req.window
                    n = (len(w.codes) - w.left_context) * SAMPLES_PER_FRAME
                    t = np.arange(n) / 24000.0
                    pcm = pcm_from_float(0.3 * np.sin(2 * np.pi * 440 * t), 24000)
                    yield code2wav_pb2.Code2WavResponse(audio=code2wav_pb2.AudioChunk(id=w.id, pcm=pcm, is_last=w.is_last))
                    if w.is_last:
                        break
                elif kind == "control" and req.control.WhichOneof("kind") == "end":
                    break
            yield code2wav_pb2.Code2WavResponse(done=common_pb2.Done(finish_reason="stop"))
        finally:
            self.log.leave()


_ADDERS = {
    "thinker": (thinker_pb2_grpc.add_ThinkerServiceServicer_to_server, "minicpmo.v1.ThinkerService"),
    "talker": (talker_pb2_grpc.add_TalkerServiceServicer_to_server, "minicpmo.v1.TalkerService"),
    "code2wav": (code2wav_pb2_grpc.add_Code2WavServiceServicer_to_server, "minicpmo.v1.Code2WavService"),
}


class FakeStage:
    """One fake stage on a loopback port with a health service that reports SERVING."""

    def __init__(self, name: str, servicer: object) -> None:
        self.name = name
        self.servicer = servicer
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        adder, service = _ADDERS[name]
        adder(servicer, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(grace=None)


class FakeStages:
    def __init__(self) -> None:
        self.logs = {name: StageLog() for name in _ADDERS}
        self.thinker = FakeThinker(self.logs["thinker"])
        self.talker = FakeTalker(self.logs["talker"])
        self.code2wav = FakeCode2Wav(self.logs["code2wav"])
        self.stages = {
            "thinker": FakeStage("thinker", self.thinker),
            "talker": FakeStage("talker", self.talker),
            "code2wav": FakeStage("code2wav", self.code2wav),
        }

    @property
    def addrs(self) -> dict[str, str]:
        return {name: stage.addr for name, stage in self.stages.items()}

    def active(self) -> dict[str, int]:
        return {name: log.active for name, log in self.logs.items()}

    def stop(self) -> None:
        for stage in self.stages.values():
            stage.stop()
