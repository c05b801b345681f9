"""Round trips through a real in-process gRPC server on loopback: protos, tensors, health, reflection."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.errors import INVALID_ARGUMENT, StageError
from services.common.grpc_server import ServeOptions, StageServer
from services.common.pb import code2wav_pb2, code2wav_pb2_grpc, common_pb2
from services.common.pcm import pcm_from_float, pcm_to_float
from services.common.tensors import tensor_from_proto, tensor_to_proto


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32])
def test_tensor_round_trip(dtype: torch.dtype) -> None:
    t = (torch.randn(3, 5) * 100).to(dtype)
    back = tensor_from_proto(tensor_to_proto(t))
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back, t)


def test_tensor_size_mismatch_is_typed_error() -> None:
    msg = tensor_to_proto(torch.zeros(2, 2))
    msg.shape[:] = [3, 2]
    with pytest.raises(StageError) as exc:
        tensor_from_proto(msg)
    assert exc.value.code == INVALID_ARGUMENT


def test_pcm_round_trip() -> None:
    x = np.sin(np.linspace(0, 100, 2400)).astype(np.float32) * 0.5
    y, sr = pcm_to_float(pcm_from_float(x, 24000))
    assert sr == 24000 and np.max(np.abs(x - y)) < 1e-4
    z, _ = pcm_to_float(pcm_from_float(x, 16000, common_pb2.PCM_FORMAT_F32LE))
    assert np.array_equal(x, z)


class _EchoCode2Wav(code2wav_pb2_grpc.Code2WavServiceServicer):
    """Echo servicer used only to exercise the wire: it turns each window's codes into a PCM payload."""

    async def Generate(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        async for req in request_iterator:
            kind = req.WhichOneof("kind")
            if kind == "window":
                samples = np.asarray(req.window.codes, dtype=np.float32) / 10000.0
                chunk = code2wav_pb2.AudioChunk(id=req.window.id, pcm=pcm_from_float(samples, 24000))
                chunk.is_last = req.window.is_last
                yield code2wav_pb2.Code2WavResponse(audio=chunk)
            elif kind == "control":
                err = StageError(INVALID_ARGUMENT, "control not supported here", "control")
                yield code2wav_pb2.Code2WavResponse(error=err.to_proto(req.control.id))

    async def GetInfo(self, request, context):  # noqa: N802
        return common_pb2.StageInfo(stage="code2wav", protocol_version="minicpmo.v1")


def test_proto_round_trip_through_loopback_server() -> None:
    async def run() -> None:
        server = StageServer(
            "code2wav",
            "minicpmo.v1.Code2WavService",
            lambda s: code2wav_pb2_grpc.add_Code2WavServiceServicer_to_server(_EchoCode2Wav(), s),
            ServeOptions(host="127.0.0.1", port=0, metrics_port=0),
        )
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = code2wav_pb2_grpc.Code2WavServiceStub(ch)
                info = await stub.GetInfo(common_pb2.GetInfoRequest(), timeout=5)
                assert info.stage == "code2wav"

                async def requests():
                    ident = common_pb2.Identity(request_id="r1", epoch=2, turn_id=1)
                    yield code2wav_pb2.Code2WavRequest(open=code2wav_pb2.Code2WavOpen(id=ident))
                    for seq in range(3):
                        ident.chunk_seq = seq
                        win = common_pb2.CodecWindow(id=ident, codes=[4218, 1, 2, seq], left_context=3)
                        win.is_last = seq == 2
                        yield code2wav_pb2.Code2WavRequest(window=win)
                    yield code2wav_pb2.Code2WavRequest(
                        control=common_pb2.Control(id=ident, end=common_pb2.End())
                    )

                got = [r async for r in stub.Generate(requests(), timeout=10)]
                kinds = [r.WhichOneof("kind") for r in got]
                assert kinds == ["audio", "audio", "audio", "error"]
                assert [r.audio.id.chunk_seq for r in got[:3]] == [0, 1, 2]
                assert got[2].audio.is_last and not got[0].audio.is_last
                assert got[0].audio.id.request_id == "r1" and got[0].audio.id.epoch == 2
                assert got[3].error.code == INVALID_ARGUMENT and got[3].error.param == "control"

                hstub = health_pb2_grpc.HealthStub(ch)
                resp = await hstub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING

                rstub = reflection_pb2_grpc.ServerReflectionStub(ch)

                async def reflect():
                    yield reflection_pb2.ServerReflectionRequest(list_services="")

                names = [
                    s.name
                    async for r in rstub.ServerReflectionInfo(reflect())
                    for s in r.list_services_response.service
                ]
                assert "minicpmo.v1.Code2WavService" in names
            await server.stop()
            assert server.server is not None
        finally:
            await server.stop()

    asyncio.run(run())
