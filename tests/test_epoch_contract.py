"""The one epoch rule, checked against all three stages as real processes over real gRPC.

The rule (services/common/stage_stream.py, protos/minicpmo/v1/common.proto, docs/design.md):
an epoch only increases; an interrupt to an epoch <= the current one is acknowledged with nothing dropped;
data stamped with a newer epoch first applies that interrupt and acknowledges it; data of an older epoch
is dropped and counted (``minicpmo_stage_stale_items_total``). Every scenario runs unchanged on the
thinker (duplex units), the talker (condition chunks) and code2wav (codec windows); only how a data
message is made differs per stage.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from stage_processes import StageProcess, start_stages, stop_all

import services.common.pb.code2wav_pb2 as code2wav_pb2
import services.common.pb.code2wav_pb2_grpc as code2wav_pb2_grpc
import services.common.pb.common_pb2 as common_pb2
import services.common.pb.talker_pb2 as talker_pb2
import services.common.pb.talker_pb2_grpc as talker_pb2_grpc
import services.common.pb.thinker_pb2 as thinker_pb2
import services.common.pb.thinker_pb2_grpc as thinker_pb2_grpc
from services.common.checkpoint import CODEC_SILENCE_ID
from services.common.pcm import pcm_from_float
from services.common.stage_stream import Admit, EpochFence
from services.common.tensors import tensor_to_proto

STAGES = ("thinker", "talker", "code2wav")


@dataclass(frozen=True)
class StageContract:
    """How to speak to one stage: its stub, its open, its data message and the replies that carry output."""

    stub: Callable[[grpc.aio.Channel], Any]
    request: type
    open: Callable[[int], Any]
    data: Callable[[int, int], Any]  # (epoch, seq) -> a data request stamped with that epoch
    outputs: tuple[str, ...]  # response kinds that carry an epoch's output


def _thinker_open(epoch: int) -> thinker_pb2.ThinkerRequest:
    return thinker_pb2.ThinkerRequest(
        open=thinker_pb2.ThinkerOpen(
            id=common_pb2.Identity(request_id="c", session_id="c", epoch=epoch),
            mode=common_pb2.STREAM_MODE_DUPLEX,
            sampling=thinker_pb2.SamplingParams(temperature=0.0),
            force_listen_units=100,  # one decision token per unit: quick on CPU
        )
    )


def _thinker_unit(epoch: int, seq: int) -> thinker_pb2.ThinkerRequest:
    wave = (0.1 * np.random.default_rng(seq).standard_normal(16_000)).astype(np.float32)
    ident = common_pb2.Identity(session_id="c", epoch=epoch, unit_seq=seq)
    return thinker_pb2.ThinkerRequest(
        unit=thinker_pb2.ThinkerUnit(id=ident, audio=pcm_from_float(wave, 16_000))
    )


def _talker_open(epoch: int) -> talker_pb2.TalkerRequest:
    return talker_pb2.TalkerRequest(
        open=talker_pb2.TalkerOpen(
            id=common_pb2.Identity(request_id="c", session_id="c", epoch=epoch),
            mode=common_pb2.STREAM_MODE_TURN,
            sampling=talker_pb2.TalkerSampling(fixed_frames=8, seed=1),  # one short window per turn
        )
    )


def _talker_chunk(epoch: int, seq: int) -> talker_pb2.TalkerRequest:
    gen = torch.Generator().manual_seed(seq)
    return talker_pb2.TalkerRequest(
        chunk=talker_pb2.TalkerChunk(
            id=common_pb2.Identity(request_id="c", epoch=epoch),
            token_ids=torch.randint(0, 150_000, (4,), generator=gen).tolist(),
            hidden=tensor_to_proto(torch.randn(4, 128, generator=gen), dtype=torch.float32),
            is_last=True,
        )
    )


def _code2wav_open(epoch: int) -> code2wav_pb2.Code2WavRequest:
    return code2wav_pb2.Code2WavRequest(
        open=code2wav_pb2.Code2WavOpen(id=common_pb2.Identity(request_id="c", epoch=epoch), seed=3)
    )


def _code2wav_window(epoch: int, seq: int) -> code2wav_pb2.Code2WavRequest:
    # The first and last window of its epoch (chunk_seq 0): 3 frames of silent context + 5 new codes.
    codes = [CODEC_SILENCE_ID] * 3 + [(seq * 97 + i * 811) % 6561 for i in range(5)]
    ident = common_pb2.Identity(request_id="c", epoch=epoch, chunk_seq=0)
    return code2wav_pb2.Code2WavRequest(
        window=common_pb2.CodecWindow(id=ident, codes=codes, left_context=3, is_last=True)
    )


CONTRACTS = {
    "thinker": StageContract(
        thinker_pb2_grpc.ThinkerServiceStub,
        thinker_pb2.ThinkerRequest,
        _thinker_open,
        _thinker_unit,
        ("unit",),
    ),
    "talker": StageContract(
        talker_pb2_grpc.TalkerServiceStub, talker_pb2.TalkerRequest, _talker_open, _talker_chunk, ("window",)
    ),
    "code2wav": StageContract(
        code2wav_pb2_grpc.Code2WavServiceStub,
        code2wav_pb2.Code2WavRequest,
        _code2wav_open,
        _code2wav_window,
        ("audio",),
    ),
}


def interrupt(contract: StageContract, new_epoch: int) -> Any:
    return contract.request(control=common_pb2.Control(interrupt=common_pb2.Interrupt(new_epoch=new_epoch)))


def end(contract: StageContract) -> Any:
    return contract.request(control=common_pb2.Control(end=common_pb2.End()))


def kind(resp: Any) -> str:
    return resp.WhichOneof("kind")


def epoch_of(resp: Any) -> int:
    return int(getattr(resp, kind(resp)).id.epoch)


@pytest.fixture(scope="module")
def stages(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, StageProcess]]:
    procs = start_stages(tiny_ckpt, tmp_path_factory.mktemp("contract_logs"), [(s, []) for s in STAGES])
    try:
        yield dict(zip(STAGES, procs, strict=True))
    finally:
        stop_all(procs)


def converse(proc: StageProcess, contract: StageContract, requests: list[Any]) -> list[Any]:
    """Send ``requests`` on one stream (then half-close) and return every reply; the stream must end clean."""

    async def run() -> list[Any]:
        async with grpc.aio.insecure_channel(proc.addr) as channel:
            call = contract.stub(channel).Generate(iter(requests), timeout=120)
            return [r async for r in call]

    replies = asyncio.run(run())
    kinds = [kind(r) for r in replies]
    assert "error" not in kinds, [r.error for r in replies if kind(r) == "error"]
    assert kinds and kinds[-1] == "done", kinds
    return replies


def outputs(contract: StageContract, replies: list[Any]) -> list[Any]:
    return [r for r in replies if kind(r) in contract.outputs]


@pytest.mark.parametrize("stage", STAGES)
def test_an_interrupt_to_an_epoch_not_newer_is_acked_with_nothing_dropped(
    stages: dict[str, StageProcess], stage: str
) -> None:
    c = CONTRACTS[stage]
    replies = converse(stages[stage], c, [c.open(2), interrupt(c, 2), interrupt(c, 1), c.data(2, 0), end(c)])
    acks = [r.interrupt_ack for r in replies if kind(r) == "interrupt_ack"]
    assert [(a.new_epoch, a.dropped_items, a.id.epoch) for a in acks] == [(2, 0, 2), (1, 0, 2)]
    out = outputs(c, replies)
    assert out and {epoch_of(r) for r in out} == {2}  # the stream went on in its epoch
    assert epoch_of(replies[-1]) == 2


@pytest.mark.parametrize("stage", STAGES)
def test_data_of_a_newer_epoch_first_applies_that_interrupt_and_acks_it(
    stages: dict[str, StageProcess], stage: str
) -> None:
    c = CONTRACTS[stage]
    replies = converse(stages[stage], c, [c.open(0), c.data(0, 0), c.data(3, 1), end(c)])
    kinds = [kind(r) for r in replies]
    assert kinds.count("interrupt_ack") == 1, kinds
    at = kinds.index("interrupt_ack")
    ack = replies[at].interrupt_ack
    assert (ack.new_epoch, ack.id.epoch) == (3, 3)
    assert all(epoch_of(r) == 0 for r in outputs(c, replies[:at]))
    after = outputs(c, replies[at + 1 :])
    assert after and all(epoch_of(r) == 3 for r in after)
    assert epoch_of(replies[-1]) == 3


@pytest.mark.parametrize("stage", STAGES)
def test_data_of_an_older_epoch_is_dropped_and_counted(stages: dict[str, StageProcess], stage: str) -> None:
    c = CONTRACTS[stage]
    proc = stages[stage]
    stale_before = proc.metric("minicpmo_stage_stale_items_total")
    replies = converse(
        proc, c, [c.open(0), interrupt(c, 2), c.data(1, 0), c.data(0, 1), c.data(2, 2), end(c)]
    )
    kinds = [kind(r) for r in replies]
    assert (
        kinds.count("interrupt_ack") == 1
        and replies[kinds.index("interrupt_ack")].interrupt_ack.new_epoch == 2
    )
    out = outputs(c, replies)
    assert out and all(epoch_of(r) == 2 for r in out)  # nothing of epochs 1 and 0 was computed
    assert proc.metric("minicpmo_stage_stale_items_total") == stale_before + 2


@pytest.mark.parametrize("stage", STAGES)
def test_the_epoch_only_increases(stages: dict[str, StageProcess], stage: str) -> None:
    c = CONTRACTS[stage]
    replies = converse(
        stages[stage], c, [c.open(0), interrupt(c, 5), interrupt(c, 3), c.data(3, 0), c.data(5, 1), end(c)]
    )
    acks = [r.interrupt_ack for r in replies if kind(r) == "interrupt_ack"]
    assert [(a.new_epoch, a.id.epoch) for a in acks] == [(5, 5), (3, 5)] and acks[1].dropped_items == 0
    out = outputs(c, replies)
    assert out and all(epoch_of(r) == 5 for r in out)


def test_the_fence_itself() -> None:
    fence = EpochFence("test", 4)
    assert fence.admit(None) is Admit.CURRENT and fence.admit(4) is Admit.CURRENT
    assert fence.admit(7) is Admit.NEWER and fence.epoch == 4  # the caller applies the interrupt
    assert fence.advance(7) and fence.epoch == 7
    assert not fence.advance(7) and not fence.advance(2) and fence.epoch == 7
    assert fence.admit(6) is Admit.STALE and fence.admit(0) is Admit.STALE and fence.stale == 2


def test_the_driver_reads_a_bounded_number_of_requests_ahead() -> None:
    """A client that floods a stream is read only MAX_QUEUED_REQUESTS ahead of what the stage took."""
    from services.common.stage_stream import MAX_QUEUED_REQUESTS, StageStream, StageStreamDriver

    release = asyncio.Event()
    pulled = 0

    class Slow(StageStream):
        data_kind = "window"

        def identity(self) -> common_pb2.Identity:
            return common_pb2.Identity()

        async def on_data(self, data: Any) -> list[Any]:
            await release.wait()  # the stage is busy: nothing more is taken from the inbox
            self.finished = True
            return []

    async def flood() -> Any:
        nonlocal pulled
        yield _code2wav_open(0)
        for i in range(10 * MAX_QUEUED_REQUESTS):
            pulled += 1
            yield _code2wav_window(0, i)

    async def run() -> int:
        driver = StageStreamDriver(
            "test", code2wav_pb2.Code2WavRequest, code2wav_pb2.Code2WavResponse, lambda _o: Slow()
        )
        task = asyncio.create_task(anext(aiter(driver.generate(flood())), None))
        await asyncio.sleep(0.2)
        seen = pulled
        release.set()
        await task
        return seen

    seen = asyncio.run(run())
    assert MAX_QUEUED_REQUESTS <= seen <= MAX_QUEUED_REQUESTS + 2
