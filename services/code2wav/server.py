"""Thin gRPC front of the Code2Wav stage: proto messages <-> :class:`Code2WavEngine` calls.

One ``Generate`` call is one stream, run by :class:`~services.common.stage_stream.StageStreamDriver`:
``open`` first (voice, seed, output format), then codec windows and controls in any interleaving. Each
window's audio goes back as an ``AudioChunk`` carrying the window's identity; ``is_last`` marks the end
of an epoch's audio. Epochs follow the one rule of :mod:`services.common.stage_stream`: an interrupt (or
a window of a newer epoch) restarts the stream from its voice and is acknowledged with the number of
queued windows dropped; windows of older epochs are dropped. ``Control.end`` or closing the request side
finishes the queued work and sends ``Done``. Validation failures end the stream with a typed ``Error``.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import torch

from services.code2wav.engine import STAGE, Code2WavEngine, StreamHandle
from services.code2wav.model.prompt import PromptFeatures, ReferenceAudioError
from services.code2wav.runner import MAX_NEW_TOKENS, WindowResult
from services.common.errors import FAILED_PRECONDITION, INVALID_ARGUMENT, OUT_OF_ORDER, StageError
from services.common.pb import code2wav_pb2, code2wav_pb2_grpc, common_pb2
from services.common.pcm import pcm_from_float, pcm_to_float
from services.common.stage_stream import Inbox, Interrupted, StageServicer, StageStream, StageStreamDriver
from services.common.tensors import tensor_from_proto, tensor_to_proto

SERVICE_FULL_NAME = "minicpmo.v1.Code2WavService"
Response = code2wav_pb2.Code2WavResponse


class Code2WavStream(StageStream[Response]):
    """One stream: windows in chunk order per epoch, audio out, Done once the end is reached."""

    data_kind = "window"

    def __init__(self, engine: Code2WavEngine, opened: code2wav_pb2.Code2WavOpen) -> None:
        self.engine = engine
        self.opened = opened
        self.fmt = opened.output_format or common_pb2.PCM_FORMAT_S16LE
        self.handle: StreamHandle | None = None
        self.expected_seq = 0  # chunk_seq of the next window of the current epoch
        self.samples = self.windows = 0
        self.ending = False

    def identity(self) -> common_pb2.Identity:
        ident = common_pb2.Identity()
        ident.CopyFrom(self.opened.id)
        if self.handle is not None:
            ident.epoch = self.handle.epoch
        return ident

    async def start(self, inbox: Inbox) -> Sequence[Response]:
        opened = self.opened
        reference = pcm_to_float(opened.ref_audio) if opened.ref_audio.data else None
        seed = opened.seed if opened.HasField("seed") else None
        prompt = None
        if opened.HasField("voice"):
            if reference is not None:
                raise StageError(INVALID_ARGUMENT, "send either ref_audio or voice, not both", "open.voice")
            voice = opened.voice
            prompt = self.engine.stored_voice(voice_key(voice), lambda: voice_parts(voice))
        self.handle = await self.engine.open_stream(
            opened.id.request_id or uuid.uuid4().hex,
            reference,
            seed,
            epoch=opened.id.epoch,
            outputs=inbox,
            prompt=prompt,
        )
        return ()

    async def on_data(self, window: common_pb2.CodecWindow) -> Sequence[Response]:
        assert self.handle is not None
        if window.id.chunk_seq != self.expected_seq:
            raise StageError(
                OUT_OF_ORDER,
                f"window chunk_seq {window.id.chunk_seq}, expected {self.expected_seq}",
                "window.id.chunk_seq",
            )
        tag = common_pb2.Identity()
        tag.CopyFrom(window.id)
        self.engine.submit(self.handle, list(window.codes), int(window.left_context), window.is_last, tag)
        self.expected_seq += 1
        return ()

    async def on_interrupt(self, new_epoch: int) -> Interrupted:
        assert self.handle is not None
        self.expected_seq = 0
        return Interrupted(self.engine.interrupt(self.handle, new_epoch))

    async def on_end(self) -> Sequence[Response]:
        self.ending = True  # flush needs nothing: windows run as soon as they arrive
        return ()

    async def advance(self) -> Sequence[Response]:
        handle = self.handle
        if not self.ending or handle is None or handle.pending or handle.in_flight:
            return ()
        self.finished = True
        usage = common_pb2.Usage(extra={"audio_samples": self.samples, "codec_windows": self.windows})
        return [Response(done=common_pb2.Done(id=self.identity(), finish_reason="stop", usage=usage))]

    async def on_event(self, event: tuple[common_pb2.Identity, Any]) -> Sequence[Response]:
        assert self.handle is not None
        tag, item = event
        if item is None or tag.epoch < self.handle.epoch:
            return ()  # a window of an abandoned epoch finished: nothing to send
        if isinstance(item, StageError):
            self.finished = True
            return [Response(error=item.to_proto(tag))]
        assert isinstance(item, WindowResult)
        self.samples += item.samples.shape[0]
        self.windows += 1
        pcm = pcm_from_float(item.samples, self.engine.runner.model.sample_rate, self.fmt)
        return [Response(audio=code2wav_pb2.AudioChunk(id=tag, pcm=pcm, is_last=item.is_last))]

    async def close(self) -> None:
        if self.handle is not None:
            self.engine.close(self.handle)


class Code2WavServicer(StageServicer, code2wav_pb2_grpc.Code2WavServiceServicer):
    """Adapter between the proto stream and the engine; holds no model state of its own."""

    def __init__(self, engine: Code2WavEngine, info: common_pb2.StageInfo) -> None:
        self.engine = engine
        self.info = info
        self.driver = StageStreamDriver(
            STAGE,
            code2wav_pb2.Code2WavRequest,
            Response,
            lambda opened: Code2WavStream(engine, opened),
            missing_open_code=FAILED_PRECONDITION,
        )

    async def EncodeVoice(  # noqa: N802
        self, request: code2wav_pb2.Code2WavVoiceRequest, context: grpc.aio.ServicerContext
    ) -> code2wav_pb2.VoicePrompt:
        """Featurise a reference clip once (voice registry); an unusable clip is INVALID_ARGUMENT."""
        if not request.ref_audio.data:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ref_audio is empty")
        try:
            samples, rate = pcm_to_float(request.ref_audio)
            features = await self.engine.encode_voice(samples, rate)
        except (ReferenceAudioError, StageError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return voice_prompt(features)


def voice_parts(msg: code2wav_pb2.VoicePrompt) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """A stored VoicePrompt -> (tokens, mel, spk_emb, digest) tensors on the CPU."""
    return (
        tensor_from_proto(msg.tokens),
        tensor_from_proto(msg.mel),
        tensor_from_proto(msg.spk_emb),
        msg.digest,
    )


def voice_key(msg: code2wav_pb2.VoicePrompt) -> bytes:
    """The content key of stored features: a hash of every tensor's dtype, shape and bytes and of the
    digest, so equal keys always mean equal features."""
    h = hashlib.blake2b(digest_size=16)
    for t in (msg.tokens, msg.mel, msg.spk_emb):
        h.update(f"{t.dtype}:{list(t.shape)}:{len(t.data)}".encode())
        h.update(t.data)
    h.update(msg.digest.encode())
    return h.digest()


def voice_prompt(features: PromptFeatures) -> code2wav_pb2.VoicePrompt:
    """Prompt features -> the VoicePrompt the gateway stores (tokens int32, mel and x-vector fp32)."""
    return code2wav_pb2.VoicePrompt(
        tokens=tensor_to_proto(features.tokens.to(torch.int32)),
        mel=tensor_to_proto(features.mel, torch.float32),
        spk_emb=tensor_to_proto(features.spk_emb, torch.float32),
        digest=features.digest,
    )


def stage_info(engine: Code2WavEngine, model_version: str) -> common_pb2.StageInfo:
    runner = engine.runner
    dims = runner.model.dims
    return common_pb2.StageInfo(
        stage=STAGE,
        model="openbmb/MiniCPM-o-4_5",
        model_version=model_version,
        protocol_version="minicpmo.v1",
        device=str(runner.device),
        compute_dtype=common_pb2.DTYPE_FLOAT32,
        capabilities=["turn", "duplex", "reference_voice", "interrupt"],
        limits={
            "max_streams": engine.max_streams,
            "max_batch": engine.max_batch,
            "sample_rate": runner.model.sample_rate,
            "left_context": runner.lookahead,
            "window_new_codes": 25,
            "max_new_codes": MAX_NEW_TOKENS,
            "min_new_codes": runner.min_new_tokens,
            "codec_vocab": dims.vocab_size,
        },
        properties={
            "cfm_steps": str(runner.n_timesteps),
            "cfg_rate": str(dims.cfg_rate),
            "cache_dtype": str(runner.cache_dtype).removeprefix("torch."),
            "nsf_noise": str(runner.nsf_noise).lower(),
            "cuda_graphs": str(getattr(runner, "cuda_graphs", False)).lower(),
            "dit": runner.flow.dit_impl,
            "dit_dtype": str(runner.flow.compute_dtype).removeprefix("torch."),
            "dit_depth": str(dims.dit_depth),
            "dit_hidden": str(dims.dit_hidden),
            "window_codes": ",".join(str(n) for n in engine.window_codes),  # steady sizes with graphs
        },
    )


def add_servicer(servicer: Code2WavServicer) -> Callable[[grpc.aio.Server], None]:
    def add(server: grpc.aio.Server) -> None:
        code2wav_pb2_grpc.add_Code2WavServiceServicer_to_server(servicer, server)

    return add
