"""Batched duplex unit encoding (tiny checkpoint, CPU fp32): N sessions' units in one streaming-Whisper pass
give the same numbers, to float rounding, as N passes of one unit each, and keep each session's encoder
cache its own; the encoder queue gathers units that wait together into one pass; one unit's bad input fails
only that unit."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.errors import StageError
from services.common.pb import common_pb2, thinker_pb2
from services.common.pcm import pcm_from_float
from services.thinker.backend import build_backend
from services.thinker.duplex import CHUNK_EOS, LISTEN, UNIT_CLOSE, WHISPER_BATCH, DuplexSession
from services.thinker.duplex_encode import DuplexUnitEncoder, encode_unit, encode_units
from services.thinker.engine import EngineConfig
from services.thinker.model.audio import StreamPiece

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def backend(tiny_ckpt: Path):
    cfg = EngineConfig(kv_budget_bytes=16 << 20, max_step_tokens=128)
    b = build_backend(str(tiny_ckpt), "cpu", "float32", cfg)
    yield b
    b.executor.shutdown(wait=False)


def _wave(seed: int, seconds: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    tone = 0.2 * np.sin(2 * np.pi * (200 + 40 * seed) * t)
    return (tone + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


def _unit(seed: int) -> thinker_pb2.ThinkerUnit:
    return thinker_pb2.ThinkerUnit(audio=pcm_from_float(_wave(seed), 16000))


def _open(name: str) -> thinker_pb2.ThinkerOpen:
    return thinker_pb2.ThinkerOpen(
        id=common_pb2.Identity(session_id=name),
        mode=common_pb2.STREAM_MODE_DUPLEX,
        sampling=thinker_pb2.SamplingParams(temperature=0.0),
        want_speech=True,
    )


# A batched pass sums in another order than a pass of one stream (the convolutions over a batch, attention
# over keys padded to the longest stream), so rows agree to float rounding, not bit for bit.
CLOSE = {"rtol": 1e-5, "atol": 1e-5}


def _same_state(a, b) -> None:  # noqa: ANN001
    assert a.frames == b.frames
    assert torch.equal(a.mel_tail, b.mel_tail)
    assert len(a.kv) == len(b.kv)
    for (ka, va), (kb, vb) in zip(a.kv, b.kv, strict=True):
        torch.testing.assert_close(ka, kb, **CLOSE)
        torch.testing.assert_close(va, vb, **CLOSE)
    assert a.slot != b.slot or a.pool is not b.pool  # each stream its own slot


def test_batched_whisper_pass_equals_one_pass_per_stream(backend) -> None:  # noqa: ANN001
    """Streams at different points (a first unit without left context beside streams with 1-3 cached
    units) encoded together equal the same streams encoded one at a time, rows and caches alike."""
    model = backend.model
    mels = torch.randn(4, 80, 4 * 100 + 2, generator=torch.Generator().manual_seed(0))
    history = [0, 1, 3, 2]  # units each stream has already encoded
    single = [model.new_audio_stream() for _ in history]
    batched = [model.new_audio_stream() for _ in history]
    for s, done in enumerate(history):
        for k in range(done):
            piece = mels[s, :, 100 * k : 100 * (k + 1)]
            nxt = mels[s, :, 100 * (k + 1) : 100 * (k + 1) + 2]
            model.get_audio_embeds_streaming(piece, single[s], nxt)
            model.get_audio_embeds_streaming(piece, batched[s], nxt)
    pieces, alone = [], []
    for s, done in enumerate(history):
        piece = mels[s, :, 100 * done : 100 * (done + 1)]
        nxt = mels[s, :, 100 * (done + 1) : 100 * (done + 1) + 2]
        behind = None if done == 0 else mels[s, :, 100 * done - 2 : 100 * done] * 0.5  # a recomputed tail
        alone.append(model.get_audio_embeds_streaming(piece, single[s], nxt, behind))
        pieces.append(StreamPiece(piece, batched[s], nxt, behind))
    together = model.get_audio_embeds_streaming_batch(pieces)
    assert together.shape == (4, 10, model.dims.hidden_size)
    for s in range(4):
        torch.testing.assert_close(together[s], alone[s], **CLOSE, msg=f"stream {s}")
        _same_state(batched[s], single[s])
    assert len({st.frames for st in batched}) == 4  # the caches really had different lengths


def test_batched_whisper_pass_refuses_a_stream_twice(backend) -> None:  # noqa: ANN001
    model = backend.model
    state = model.new_audio_stream()
    mel = torch.zeros(80, 100)
    with pytest.raises(ValueError, match="one call after another"):
        model.get_audio_embeds_streaming_batch([StreamPiece(mel, state), StreamPiece(mel, state)])
    assert state.frames == 0 and not state.kv


def test_batched_unit_encode_equals_single_unit_encodes(backend) -> None:  # noqa: ANN001
    """Four duplex sessions at different points (0-3 units in): their next units encoded in one pass give
    the token ids and embeddings of four separate passes, and each session's encoder state stays its own."""
    history = [0, 2, 1, 3]
    alone = [DuplexSession(backend, _open(f"a{i}")) for i in range(4)]
    together = [DuplexSession(backend, _open(f"b{i}")) for i in range(4)]
    for s, done in enumerate(history):
        for k in range(done):
            for sess in (alone[s], together[s]):
                encode_unit(backend, sess, _unit(10 * s + k), False)
                sess.reinject = [(LISTEN, CHUNK_EOS)[k % 2], UNIT_CLOSE]  # as a decision leaves it
    singles = [encode_unit(backend, sess, _unit(10 * s + history[s]), False) for s, sess in enumerate(alone)]
    before = (WHISPER_BATCH._sum.get(), sum(b.get() for b in WHISPER_BATCH._buckets))
    batch = encode_units(
        backend, [(sess, _unit(10 * s + history[s]), False) for s, sess in enumerate(together)]
    )
    assert WHISPER_BATCH._sum.get() - before[0] == 4  # one pass of four units
    assert sum(b.get() for b in WHISPER_BATCH._buckets) - before[1] == 1
    for s in range(4):
        one, many = singles[s], batch[s]
        assert not isinstance(many, BaseException)
        assert many.token_ids == one.token_ids
        assert many.embeds is not None and one.embeds is not None
        torch.testing.assert_close(many.embeds, one.embeds, **CLOSE, msg=f"session {s}")
        assert many.emit_hidden and many.feed_last
        _same_state(together[s].audio_state, alone[s].audio_state)


def test_a_bad_unit_fails_alone(backend) -> None:  # noqa: ANN001
    good, bad = DuplexSession(backend, _open("g")), DuplexSession(backend, _open("x"))
    three_frames = thinker_pb2.ThinkerUnit(audio=pcm_from_float(_wave(1), 16000), frames=[b"a", b"b", b"c"])
    out = encode_units(backend, [(good, _unit(0), False), (bad, three_frames, False)])
    assert not isinstance(out[0], BaseException) and len(out[0].token_ids) == 11
    assert isinstance(out[1], StageError) and "at most two frames" in str(out[1])
    assert bad.audio_state.frames == 0  # nothing of the bad unit reached its encoder


def test_encoder_queue_gathers_waiting_units_into_one_pass(backend) -> None:  # noqa: ANN001
    """Units handed to the encoder while a pass (here: a blocked executor) is busy go in one pass."""
    gate = threading.Event()
    executor = ThreadPoolExecutor(1, "test-encode")
    try:
        executor.submit(gate.wait)  # the executor is busy until every session has queued its unit
        local = dataclasses.replace(backend, executor=executor, duplex_encoder=None)
        encoder = DuplexUnitEncoder(local)
        sessions = [DuplexSession(local, _open(f"q{i}")) for i in range(3)]
        reference = [DuplexSession(local, _open(f"r{i}")) for i in range(3)]
        expected = [encode_unit(local, r, _unit(i), False) for i, r in enumerate(reference)]
        calls = WHISPER_BATCH._sum.get(), sum(b.get() for b in WHISPER_BATCH._buckets)

        async def run() -> list:
            tasks = [asyncio.ensure_future(encoder.encode(s, _unit(i))) for i, s in enumerate(sessions)]
            await asyncio.sleep(0.05)
            gate.set()
            return await asyncio.gather(*tasks)

        got = [s.assemble_unit(enc, False) for s, enc in zip(sessions, asyncio.run(run()), strict=True)]
        assert WHISPER_BATCH._sum.get() - calls[0] == 3
        assert sum(b.get() for b in WHISPER_BATCH._buckets) - calls[1] == 1
        for work, ref in zip(got, expected, strict=True):
            assert work.token_ids == ref.token_ids
            torch.testing.assert_close(work.embeds, ref.embeds, **CLOSE)
    finally:
        gate.set()
        executor.shutdown(wait=True)
