"""Thin gRPC front of the Code2Wav stage: proto messages <-> :class:`Code2WavEngine` calls.

One ``Generate`` call is one stream: ``open`` first (voice, seed, output format), then codec windows and
controls in any interleaving. Each window's audio goes back as an ``AudioChunk`` carrying the window's
identity; ``is_last`` marks the end of an epoch's audio. ``Control.interrupt`` (or a window of a newer
epoch) restarts the stream and is acknowledged with the number of queued windows dropped; windows of
older epochs arriving late are ignored. ``Control.end`` or closing the request side finishes the queued
work and sends ``Done``. Validation failures end the stream with a typed ``Error``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from services.code2wav.engine import STAGE, Code2WavEngine, StreamHandle
from services.code2wav.runner import MAX_NEW_TOKENS, WindowResult
from services.common.errors import FAILED_PRECONDITION, INTERNAL, INVALID_ARGUMENT, OUT_OF_ORDER, StageError
from services.common.metrics import ERRORS, REQUESTS, STREAMS_ACTIVE
from services.common.pb import code2wav_pb2, code2wav_pb2_grpc, common_pb2
from services.common.tensors import pcm_from_float, pcm_to_float

SERVICE_FULL_NAME = "minicpmo.v1.Code2WavService"
_CONTROL = object()  # tag of items the request reader puts on a stream's output queue
_END = object()


def _error(exc: StageError, identity: common_pb2.Identity | None) -> code2wav_pb2.Code2WavResponse:
    ERRORS.labels(STAGE, exc.code_name).inc()
    return code2wav_pb2.Code2WavResponse(error=exc.to_proto(identity))


class Code2WavServicer(code2wav_pb2_grpc.Code2WavServiceServicer):
    """Adapter between the proto stream and the engine; holds no model state of its own."""

    def __init__(self, engine: Code2WavEngine, info: common_pb2.StageInfo) -> None:
        self.engine = engine
        self.info = info

    async def GetInfo(
        self, request: common_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.StageInfo:  # noqa: N802
        return self.info

    async def Generate(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[code2wav_pb2.Code2WavRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[code2wav_pb2.Code2WavResponse]:
        requests = request_iterator.__aiter__()
        try:
            first = await requests.__anext__()
        except StopAsyncIteration:
            return
        if first.WhichOneof("kind") != "open":
            yield _error(StageError(FAILED_PRECONDITION, "the first message must be open", "open"), None)
            return
        opened = first.open
        identity = common_pb2.Identity()
        identity.CopyFrom(opened.id)
        fmt = opened.output_format or common_pb2.PCM_FORMAT_S16LE
        try:
            reference = pcm_to_float(opened.ref_audio) if opened.ref_audio.data else None
            seed = opened.seed if opened.HasField("seed") else None
            handle = await self.engine.open_stream(
                identity.request_id or uuid.uuid4().hex, reference, seed, epoch=identity.epoch
            )
        except StageError as exc:
            yield _error(exc, identity)
            return
        REQUESTS.labels(STAGE).inc()
        STREAMS_ACTIVE.labels(STAGE).inc()
        reader = asyncio.create_task(self._read(requests, handle))
        samples = windows = 0
        ending = False
        try:
            while True:
                if ending and not handle.pending and not handle.in_flight and handle.outputs.empty():
                    usage = common_pb2.Usage(extra={"audio_samples": samples, "codec_windows": windows})
                    done_id = common_pb2.Identity()
                    done_id.CopyFrom(identity)
                    done_id.epoch = handle.epoch
                    yield code2wav_pb2.Code2WavResponse(
                        done=common_pb2.Done(id=done_id, finish_reason="stop", usage=usage)
                    )
                    return
                tag, item = await handle.outputs.get()
                if item is None:
                    continue  # a window of an abandoned epoch finished; nothing to send
                if isinstance(item, StageError):
                    yield _error(item, tag if isinstance(tag, common_pb2.Identity) else identity)
                    return
                if tag is _CONTROL:
                    if item is _END:
                        ending = True
                    else:
                        yield item
                    continue
                assert isinstance(item, WindowResult)
                samples += item.samples.shape[0]
                windows += 1
                pcm = pcm_from_float(item.samples, self.engine.runner.model.sample_rate, fmt)
                yield code2wav_pb2.Code2WavResponse(
                    audio=code2wav_pb2.AudioChunk(id=tag, pcm=pcm, is_last=item.is_last)
                )
        finally:
            reader.cancel()
            self.engine.close(handle)
            STREAMS_ACTIVE.labels(STAGE).dec()

    async def _read(
        self, requests: AsyncIterator[code2wav_pb2.Code2WavRequest], handle: StreamHandle
    ) -> None:
        """Validate and forward requests; anything fatal is queued as a StageError for the writer."""
        expected_seq = 0
        try:
            async for request in requests:
                kind = request.WhichOneof("kind")
                if kind == "window":
                    window = request.window
                    epoch = window.id.epoch
                    if epoch < handle.epoch:
                        continue  # late window of an interrupted epoch
                    if epoch > handle.epoch:
                        self.engine.interrupt(handle, epoch)
                        expected_seq = 0
                    if window.id.chunk_seq != expected_seq:
                        raise StageError(
                            OUT_OF_ORDER,
                            f"window chunk_seq {window.id.chunk_seq}, expected {expected_seq}",
                            "window.id.chunk_seq",
                        )
                    tag = common_pb2.Identity()
                    tag.CopyFrom(window.id)
                    self.engine.submit(
                        handle, list(window.codes), int(window.left_context), window.is_last, tag
                    )
                    expected_seq += 1
                elif kind == "control":
                    await self._control(request.control, handle)
                    if request.control.WhichOneof("kind") == "end":
                        return
                    if request.control.WhichOneof("kind") == "interrupt":
                        expected_seq = 0
                else:
                    raise StageError(FAILED_PRECONDITION, "stream is already open", "open")
            handle.outputs.put_nowait((_CONTROL, _END))
        except StageError as exc:
            handle.outputs.put_nowait((_CONTROL, exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - report instead of leaving the writer waiting
            handle.outputs.put_nowait((_CONTROL, StageError(INTERNAL, f"request reader failed: {exc}")))

    async def _control(self, control: common_pb2.Control, handle: StreamHandle) -> None:
        kind = control.WhichOneof("kind")
        if kind == "interrupt":
            new_epoch = control.interrupt.new_epoch
            if new_epoch <= handle.epoch:
                raise StageError(
                    INVALID_ARGUMENT,
                    f"interrupt epoch {new_epoch} must exceed {handle.epoch}",
                    "control.interrupt",
                )
            dropped = self.engine.interrupt(handle, new_epoch)
            ack_id = common_pb2.Identity()
            ack_id.CopyFrom(control.id)
            ack = common_pb2.InterruptAck(id=ack_id, new_epoch=new_epoch, dropped_items=dropped)
            handle.outputs.put_nowait((_CONTROL, code2wav_pb2.Code2WavResponse(interrupt_ack=ack)))
        elif kind == "end":
            handle.outputs.put_nowait((_CONTROL, _END))
        # flush: windows run as soon as they arrive, so there is nothing buffered to force out.


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
            "dit_depth": str(dims.dit_depth),
            "dit_hidden": str(dims.dit_hidden),
        },
    )


def add_servicer(servicer: Code2WavServicer) -> Any:
    def add(server: grpc.aio.Server) -> None:
        code2wav_pb2_grpc.add_Code2WavServiceServicer_to_server(servicer, server)

    return add
