"""Code2Wav gRPC round trips in-process on the tiny checkpoint: audio chunks with identities and exact
sample counts, Done, GetInfo, typed errors (order, reference audio, first message) and interrupts."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
import types
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from services.common.checkpoint import CODEC_SILENCE_ID
from services.common.errors import BAD_REFERENCE_AUDIO, FAILED_PRECONDITION, OUT_OF_ORDER
from services.common.grpc_server import ServeOptions, StageServer
from services.common.pb import code2wav_pb2, code2wav_pb2_grpc, common_pb2
from services.common.pcm import pcm_from_float

CODES = [(i * 811) % 6561 for i in range(40)]


def _args(ckpt: Path) -> argparse.Namespace:
    return argparse.Namespace(
        checkpoint=str(ckpt),
        device="cpu",
        max_batch=8,
        max_streams=4,
        cfm_steps=10,
        cache_dtype="float32",
        nsf_noise="off",
        cuda_graphs="off",
        voice_cache=4,
    )


def _open(request_id: str, epoch: int = 0, ref: common_pb2.Pcm | None = None) -> code2wav_pb2.Code2WavRequest:
    msg = code2wav_pb2.Code2WavOpen(id=common_pb2.Identity(request_id=request_id, epoch=epoch), seed=3)
    if ref is not None:
        msg.ref_audio.CopyFrom(ref)
    return code2wav_pb2.Code2WavRequest(open=msg)


def _window(seq: int, codes: list[int], last: bool, epoch: int = 0) -> code2wav_pb2.Code2WavRequest:
    ident = common_pb2.Identity(request_id="r", epoch=epoch, chunk_seq=seq)
    return code2wav_pb2.Code2WavRequest(
        window=common_pb2.CodecWindow(id=ident, codes=codes, left_context=3, is_last=last)
    )


def _control(**kind: object) -> code2wav_pb2.Code2WavRequest:
    return code2wav_pb2.Code2WavRequest(control=common_pb2.Control(**kind))


async def _talk(stub, requests: list, gate: asyncio.Event | None = None, gate_after: int = 0) -> list:  # noqa: ANN001
    """Send ``requests`` (pausing after ``gate_after`` of them until ``gate`` is set) and collect replies."""

    async def gen() -> AsyncIterator[code2wav_pb2.Code2WavRequest]:
        for i, r in enumerate(requests):
            if gate is not None and i == gate_after:
                await gate.wait()
            yield r

    replies = []
    async for reply in stub.Generate(gen()):
        replies.append(reply)
        if gate is not None and reply.WhichOneof("kind") == "audio":
            gate.set()
    return replies


def test_grpc_round_trip(tiny_ckpt: Path) -> None:
    from services.code2wav.server import SERVICE_FULL_NAME, Code2WavServicer, add_servicer, stage_info
    from services.code2wav.service import build_engine

    async def scenario() -> None:
        engine, ckpt = build_engine(_args(tiny_ckpt))
        await engine.start()
        servicer = Code2WavServicer(engine, stage_info(engine, "4.5"))
        options = ServeOptions(host="127.0.0.1", port=0, metrics_port=0)
        server = StageServer(
            "code2wav", SERVICE_FULL_NAME, add_servicer(servicer), options, drain=engine.drain
        )
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = code2wav_pb2_grpc.Code2WavServiceStub(channel)
                info = await stub.GetInfo(common_pb2.GetInfoRequest())
                assert info.stage == "code2wav" and info.limits["sample_rate"] == 24000

                # Turn: two windows, end -> two chunks (20160 and (8 + 12) * 480 samples) and Done.
                first = [CODEC_SILENCE_ID] * 3 + CODES[:25]
                last = first[-3:] + CODES[25:28]
                replies = await _talk(
                    stub,
                    [
                        _open("turn"),
                        _window(0, first, False),
                        _window(1, last, True),
                        _control(end=common_pb2.End()),
                    ],
                )
                kinds = [r.WhichOneof("kind") for r in replies]
                assert kinds == ["audio", "audio", "done"], kinds
                a0, a1 = replies[0].audio, replies[1].audio
                assert (a0.id.chunk_seq, a0.is_last, a1.id.chunk_seq, a1.is_last) == (0, False, 1, True)
                assert a0.pcm.sample_rate == 24000 and a0.pcm.format == common_pb2.PCM_FORMAT_S16LE
                assert len(a0.pcm.data) // 2 == 20160 and len(a1.pcm.data) // 2 == (8 + 12) * 480
                assert np.abs(np.frombuffer(a0.pcm.data, "<i2")).max() > 100
                assert replies[2].done.usage.extra["audio_samples"] == 20160 + 9600

                # Out-of-order chunk_seq -> OUT_OF_ORDER; a second open -> FAILED_PRECONDITION.
                replies = await _talk(stub, [_open("ooo"), _window(1, first, False)])
                assert replies[-1].error.code == OUT_OF_ORDER
                replies = await _talk(stub, [_window(0, first, False)])
                assert replies[-1].error.code == FAILED_PRECONDITION

                # Too-short reference voice -> BAD_REFERENCE_AUDIO before any window.
                short = pcm_from_float(np.full(8000, 0.1, np.float32), 16000)
                replies = await _talk(stub, [_open("ref", ref=short)])
                assert replies[-1].error.code == BAD_REFERENCE_AUDIO

                # Interrupt after the first chunk: ack for epoch 1, then epoch-1 audio only, then Done.
                gate = asyncio.Event()
                replies = await _talk(
                    stub,
                    [
                        _open("int"),
                        _window(0, first, False),
                        _window(1, first[-3:] + CODES[25:50], False),
                        _control(interrupt=common_pb2.Interrupt(new_epoch=1)),
                        _window(0, [CODEC_SILENCE_ID] * 3 + CODES[:5], True, epoch=1),
                        _control(end=common_pb2.End()),
                    ],
                    gate=gate,
                    gate_after=3,
                )
                kinds = [r.WhichOneof("kind") for r in replies]
                ack_at = kinds.index("interrupt_ack")
                assert replies[ack_at].interrupt_ack.new_epoch == 1
                after = [r.audio for r in replies[ack_at:] if r.WhichOneof("kind") == "audio"]
                assert [(a.id.epoch, a.id.chunk_seq, a.is_last) for a in after] == [(1, 0, True)]
                assert len(after[0].pcm.data) // 2 == 2 * 8 * 480  # last and first window: all 8 tokens speak
                assert kinds[-1] == "done"
        finally:
            await server.stop(grace=0.1)
            await engine.stop()

    asyncio.run(scenario())


def test_talker_windows_cover_every_code() -> None:
    from services.code2wav.dump import talker_windows

    codes = list(range(53))
    wins = talker_windows(codes, 3)
    assert [len(w) for w, _ in wins] == [28, 28, 6] and [last for _, last in wins] == [False, False, True]
    assert wins[0][0][:3] == [CODEC_SILENCE_ID] * 3
    assert [c for w, _ in wins for c in w[3:]] == codes[3 - 3 : 22] + codes[22:47] + codes[47:]


def test_engine_batches_streams_and_interrupt_drops_queued_windows(
    tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Also: the scheduler's steps go through the slow-step timer (at 5x the stage threshold, here set
    below any step), whose line names the batch and how many of its windows were a stream's first."""
    from services.code2wav.service import build_engine
    from services.common import slow_steps

    monkeypatch.setattr(slow_steps, "_threshold_ms", 0.001)
    caplog.set_level(logging.WARNING, logger="services.common.slow_steps")

    async def scenario() -> None:
        engine, _ = build_engine(_args(tiny_ckpt))
        await engine.start()
        try:
            a = await engine.open_stream("a", None, seed=1)
            b = await engine.open_stream("b", None, seed=2)
            first = [CODEC_SILENCE_ID] * 3 + CODES[:25]
            # Same tick, no await in between: both windows are queued before the scheduler runs, and
            # equal shapes from two streams become one batch.
            engine.submit(a, first, 3, False, "a0")
            engine.submit(b, first, 3, False, "b0")
            (tag_a, res_a), (tag_b, res_b) = await asyncio.wait_for(
                asyncio.gather(a.outputs.get(), b.outputs.get()), 300
            )
            assert (tag_a, tag_b) == ("a0", "b0") and res_a.samples.shape[0] == res_b.samples.shape[
                0
            ] == 20160
            assert list(engine.batch_history) == [2]
            assert not np.array_equal(res_a.samples, res_b.samples)  # different seeds

            # Interrupt in the same tick as two queued windows: both are dropped, nothing is emitted.
            second = first[-3:] + CODES[25:50]
            engine.submit(b, second, 3, False, "b1")
            engine.submit(b, second[-3:] + CODES[:25], 3, False, "b2")
            assert engine.interrupt(b, 1) == 2
            engine.submit(b, [CODEC_SILENCE_ID] * 3 + CODES[:4], 3, True, "b-new")
            tag_b, res_b = await asyncio.wait_for(b.outputs.get(), 300)
            assert tag_b == "b-new" and res_b.is_last and res_b.samples.shape[0] == 2 * 7 * 480
            assert b.outputs.empty() and list(engine.batch_history) == [2, 1]
        finally:
            await engine.stop()

    asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records if "code2wav: slow engine step" in r.getMessage()]
    assert any("windows" in m and "(batch 2, first_windows 2)" in m for m in lines)


def test_engine_start_warms_every_batch_size_before_it_schedules() -> None:
    """start() hands the engine's max_batch to the runner's graph warm-up (which captures batches
    1..max_batch, then freezes) before the scheduling loop exists, i.e. before the stage can serve."""
    from services.code2wav.engine import Code2WavEngine

    prompt = object()
    calls: list[tuple] = []
    engine: Code2WavEngine | None = None

    def warm_up_shapes(p: object, max_batch: int, **_: object) -> int:
        assert engine is not None
        calls.append((p, max_batch, engine._task))
        return 0

    runner = types.SimpleNamespace(open_stream=lambda *a: None, warm_up_shapes=warm_up_shapes, device="cpu")
    voices = types.SimpleNamespace(encode_file=lambda path: prompt)

    async def scenario() -> None:
        nonlocal engine
        engine = Code2WavEngine(runner, voices, "voice.wav", max_batch=5)  # type: ignore[arg-type]
        await engine.start()
        try:
            assert calls == [(prompt, 5, None)] and engine._task is not None
        finally:
            await engine.stop()

    asyncio.run(scenario())


def _manual_engine(ckpt: Path):  # noqa: ANN202 - Code2WavEngine, imported lazily like the tests do
    """An engine without its scheduling loop: the test drives collect/compute/record by hand to pin the
    interleaving it checks."""
    from services.code2wav.service import build_engine

    engine, _ = build_engine(_args(ckpt))
    engine._default_prompt = engine.voices.encode_file(engine.default_voice)
    return engine


def test_interrupt_after_a_window_was_collected_does_not_leak_old_audio(tiny_ckpt: Path) -> None:
    """The race CI once hit: a window of epoch 0 is already collected for the worker when the interrupt
    arrives. The stale window must run on the old state, and epoch 1 must start fresh: its first and last
    window holds no hold-back audio of epoch 0."""

    async def scenario() -> None:
        engine = _manual_engine(tiny_ckpt)
        s = await engine.open_stream("s", None, seed=3)
        first = [CODEC_SILENCE_ID] * 3 + CODES[:25]
        engine.submit(s, first, 3, False, "old")
        stale = engine._collect()  # collected for the worker, not yet computed
        engine.interrupt(s, 1)
        engine.submit(s, [CODEC_SILENCE_ID] * 3 + CODES[:5], 3, True, "new")
        engine._record(stale, engine._compute(stale), 0.0)  # runs on the old state; result dropped
        fresh = engine._collect()
        results = engine._compute(fresh)
        engine._record(fresh, results, 0.0)
        tags = [s.outputs.get_nowait()[0] for _ in range(s.outputs.qsize())]
        assert tags == ["old", "new"]  # "old" only wakes the reader (result None)
        assert results[0].is_last and results[0].samples.shape[0] == 2 * 8 * 480

    asyncio.run(scenario())


def _gauge(metric, *labels: str) -> float:  # noqa: ANN001
    return float((metric.labels(*labels) if labels else metric)._value.get())


def _drain_count() -> float:
    from services.common.metrics import INTERRUPT_DRAIN

    return sum(
        s.value
        for m in INTERRUPT_DRAIN.collect()
        for s in m.samples
        if s.name.endswith("_count") and s.labels.get("stage") == "code2wav"
    )


def test_batches_hold_one_shape_and_first_windows_go_first(tiny_ckpt: Path) -> None:
    """A steady window queued earlier waits for a later stream's first window; shapes never mix."""

    async def scenario() -> None:
        engine = _manual_engine(tiny_ckpt)
        a = await engine.open_stream("a", None, seed=1)
        first = [CODEC_SILENCE_ID] * 3 + CODES[:25]
        engine.submit(a, first, 3, False, "a0")
        batch = engine._collect()
        engine._record(batch, engine._compute(batch), 0.0)
        engine.submit(a, first[-3:] + CODES[25:40], 3, False, "a1")  # steady window, queued first
        b = await engine.open_stream("b", None, seed=2)
        c = await engine.open_stream("c", None, seed=3)
        engine.submit(b, first, 3, False, "b0")
        engine.submit(c, first, 3, False, "c0")
        a.audio_start = time.perf_counter()  # a's first audio is playing: a1 has slack (a CPU open is slow)
        batch = engine._collect()
        assert [w.tag for _, w in batch] == ["b0", "c0"]  # first windows, one shape, one batch
        engine._record(batch, engine._compute(batch), 0.0)
        batch = engine._collect()
        assert [w.tag for _, w in batch] == ["a1"]
        engine._record(batch, engine._compute(batch), 0.0)
        assert list(engine.batch_history)[-2:] == [2, 1]

    asyncio.run(scenario())


def _late_count(phase: str) -> float:
    from services.code2wav.engine import LATE_WINDOW_SECONDS

    return sum(
        s.value
        for m in LATE_WINDOW_SECONDS.collect()
        for s in m.samples
        if s.name.endswith("_count") and s.labels.get("phase") == phase
    )


def test_the_stream_closest_to_running_dry_goes_first(tiny_ckpt: Path) -> None:
    """Earliest deadline first: of two later windows in different shape groups, the one whose stream's
    audio runs out sooner runs first, though the other arrived earlier; a first window still goes before
    a later window whose stream has audio in hand, and a stream already past its deadline goes before a
    first window that arrived after that deadline."""

    async def scenario() -> None:
        engine = _manual_engine(tiny_ckpt)
        first = [CODEC_SILENCE_ID] * 3 + CODES[:25]
        a = await engine.open_stream("a", None, seed=1)
        b = await engine.open_stream("b", None, seed=2)
        engine.submit(a, first, 3, False, "a0")
        engine.submit(b, first, 3, False, "b0")
        batch = engine._collect()
        engine._record(batch, engine._compute(batch), 0.0)
        assert a.audio_start is not None and a.audio_sent_s > 0 and a.audio_sent_s == b.audio_sent_s
        engine.submit(b, first[-3:] + CODES[25:40], 3, False, "b1")  # 15 codes: one shape group
        engine.submit(a, first[-3:] + CODES[25:35], 3, False, "a1")  # 10 codes: another, queued later
        c = await engine.open_stream("c", None, seed=3)
        engine.submit(c, first, 3, False, "c0")
        # The playout clocks (a CPU open takes a while, so they are set rather than waited for): a's
        # playback began 30 s ago and has run dry; b's began just now, with a minute of audio in hand.
        now = time.perf_counter()
        a.audio_start, b.audio_start = now - 30.0, now
        b.audio_sent_s += 60.0
        assert engine.deadline(a) < engine.deadline(c) < engine.deadline(b)
        late_arrived, late_done = _late_count("arrived"), _late_count("done")
        order = []
        while batch := engine._collect():
            order.append([w.tag for _, w in batch])
            engine._record(batch, engine._compute(batch), 0.0)
        assert order == [["a1"], ["c0"], ["b1"]]
        # a1 arrived after its stream's audio had run out, b1 with slack: only a1 counts as late.
        assert _late_count("arrived") == late_arrived + 1 and _late_count("done") == late_done + 1
        # An interrupt starts a new first audio: the stream's playout clock starts over.
        engine.interrupt(a, 1)
        assert a.audio_start is None and a.audio_sent_s == 0.0

    asyncio.run(scenario())


def test_close_releases_a_running_window_from_the_gauge_at_once(tiny_ckpt: Path) -> None:
    """Cancel latency: the in-flight gauge drops when the stream closes, not when its batch ends; the
    batch's remaining GPU time is recorded as the drain time."""
    from services.code2wav.engine import STAGE
    from services.common.metrics import IN_FLIGHT

    async def scenario() -> None:
        engine = _manual_engine(tiny_ckpt)
        s = await engine.open_stream("s", None, seed=3)
        base = _gauge(IN_FLIGHT, STAGE)
        first = [CODEC_SILENCE_ID] * 3 + CODES[:25]
        engine.submit(s, first, 3, False, "w0")
        engine.submit(s, first[-3:] + CODES[25:40], 3, False, "w1")
        assert _gauge(IN_FLIGHT, STAGE) == base + 2
        running = engine._collect()
        drains = _drain_count()
        engine.close(s)  # one window queued, one on the "GPU"
        assert _gauge(IN_FLIGHT, STAGE) == base
        engine._record(running, engine._compute(running), 0.0)
        assert _gauge(IN_FLIGHT, STAGE) == base  # not decremented twice
        assert _drain_count() == drains + 1
        assert s.outputs.empty()  # a closed stream gets nothing

    asyncio.run(scenario())
