"""A real in-process Talker gRPC server on loopback: GetInfo, health, turn and duplex streams, interrupt,
typed errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import ServeOptions
from services.common.pb import common_pb2, talker_pb2, talker_pb2_grpc
from services.common.tensors import tensor_to_proto
from services.talker.server import build_engine, make_server, stage_info

SIL = 4218


def _chunk(n: int, seed: int, *, last: bool, epoch: int = 0, width: int = 128, turn_end: bool = False):
    gen = torch.Generator().manual_seed(seed)
    ident = common_pb2.Identity(request_id="r", epoch=epoch)
    return talker_pb2.TalkerRequest(
        chunk=talker_pb2.TalkerChunk(
            id=ident,
            token_ids=torch.randint(0, 150000, (n,), generator=gen).tolist(),
            hidden=tensor_to_proto(torch.randn(n, width, generator=gen), dtype=torch.bfloat16),
            is_last=last,
            turn_end=turn_end,
        )
    )


def _open(mode: int = common_pb2.STREAM_MODE_TURN, **sampling: int) -> talker_pb2.TalkerRequest:
    return talker_pb2.TalkerRequest(
        open=talker_pb2.TalkerOpen(
            id=common_pb2.Identity(request_id="r", session_id="s"),
            mode=mode,
            sampling=talker_pb2.TalkerSampling(**sampling),
        )
    )


async def _collect(stub, requests: list[talker_pb2.TalkerRequest]) -> list[talker_pb2.TalkerResponse]:
    async def gen() -> AsyncIterator[talker_pb2.TalkerRequest]:
        for r in requests:
            yield r

    return [r async for r in stub.Generate(gen(), timeout=120)]


def test_loopback_round_trip(tiny_ckpt: Path) -> None:
    async def run() -> None:
        engine, ckpt = build_engine(str(tiny_ckpt), "cpu", None, 4, None)
        engine.start()
        server = make_server(
            engine, stage_info(engine, ckpt, "cpu"), ServeOptions(host="127.0.0.1", port=0, metrics_port=0)
        )
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = talker_pb2_grpc.TalkerServiceStub(ch)
                info = await stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
                assert info.stage == "talker" and info.model_version == "4.5"
                assert (
                    info.properties["condition_hidden_size"] == "128" and info.limits["max_context"] == 4096
                )
                health = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service="minicpmo.v1.TalkerService"), timeout=10
                )
                assert health.status == health_pb2.HealthCheckResponse.SERVING

                # turn mode, streaming chunks, fixed frame count (gathered into one whole utterance)
                resp = await _collect(
                    stub, [_open(fixed_frames=60, seed=9), _chunk(6, 1, last=False), _chunk(4, 2, last=True)]
                )
                kinds = [r.WhichOneof("kind") for r in resp]
                assert kinds == ["window", "window", "window", "done"]
                wins = [r.window for r in resp[:3]]
                assert list(wins[0].codes[:3]) == [SIL] * 3 and [w.is_last for w in wins] == [
                    False,
                    False,
                    True,
                ]
                frames = [c for w in wins for c in w.codes[w.left_context :]]
                assert len(frames) == 60 and resp[-1].done.usage.extra["codec_frames"] == 60
                assert [r.window.id.chunk_seq for r in resp[:3]] == [0, 1, 2] and resp[
                    0
                ].window.id.request_id == "r"

                # same seed, same frames (the server path is deterministic per request)
                again = await _collect(
                    stub, [_open(fixed_frames=60, seed=9), _chunk(6, 1, last=False), _chunk(4, 2, last=True)]
                )
                assert [c for r in again[:3] for c in r.window.codes[r.window.left_context :]] == frames

                # duplex: units of 25 frames, then turn end closes the turn with one last window
                resp = await _collect(
                    stub,
                    [
                        _open(common_pb2.STREAM_MODE_DUPLEX),
                        _chunk(5, 3, last=False),
                        _chunk(5, 4, last=False),
                        _chunk(5, 5, last=False, turn_end=True),
                        talker_pb2.TalkerRequest(control=common_pb2.Control(end=common_pb2.End())),
                    ],
                )
                assert resp[-1].WhichOneof("kind") == "done"
                assert sum(r.window.is_last for r in resp if r.WhichOneof("kind") == "window") == 1

                # interrupt: ack with the new epoch; later chunks of the new epoch are served
                resp = await _collect(
                    stub,
                    [
                        _open(fixed_frames=40),
                        talker_pb2.TalkerRequest(
                            control=common_pb2.Control(
                                interrupt=common_pb2.Interrupt(new_epoch=3, reason="barge-in")
                            )
                        ),
                        _chunk(5, 6, last=True, epoch=3),
                    ],
                )
                acks = [r.interrupt_ack for r in resp if r.WhichOneof("kind") == "interrupt_ack"]
                assert len(acks) == 1 and acks[0].new_epoch == 3
                assert resp[-1].WhichOneof("kind") == "done" and resp[-1].done.id.epoch == 3

                # typed errors: hidden width mismatch, ids out of range, missing open
                for bad in (_chunk(3, 7, last=True, width=64), _chunk(3, 8, last=True)):
                    if bad.chunk.hidden.shape[1] == 128:
                        bad.chunk.token_ids[0] = 999_999
                    resp = await _collect(stub, [_open(), bad])
                    assert [r.WhichOneof("kind") for r in resp] == ["error"]
                    assert resp[0].error.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT
                resp = await _collect(stub, [_chunk(3, 9, last=True)])
                assert resp[0].error.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT
                resp = await _collect(stub, [_open(top_p=1.5)])
                assert resp[0].error.param == "sampling.top_p"
                resp = await _collect(stub, [_open(temperature=float("nan"))])
                assert resp[0].error.param == "sampling.temperature"
                assert resp[0].error.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT
        finally:
            await server.stop()
            engine.shutdown()

    asyncio.run(run())


def test_client_half_close_without_chunks_gets_done(tiny_ckpt: Path) -> None:
    async def run() -> None:
        engine, ckpt = build_engine(str(tiny_ckpt), "cpu", None, 1, None)
        engine.start()
        server = make_server(
            engine, stage_info(engine, ckpt, "cpu"), ServeOptions(host="127.0.0.1", port=0, metrics_port=0)
        )
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                resp = await _collect(talker_pb2_grpc.TalkerServiceStub(ch), [_open()])
                assert [r.WhichOneof("kind") for r in resp] == ["done"]
                # the server's own close command may still sit in the engine inbox for a moment
                for _ in range(100):
                    if engine.idle():
                        break
                    await asyncio.sleep(0.02)
                assert engine.idle()
        finally:
            await server.stop()
            engine.shutdown()

    asyncio.run(run())
