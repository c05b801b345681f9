"""Duplex sessions share the thinker's KV pool (tiny checkpoint, CPU).

A duplex session keeps its KV between units and never ends on its own. Before the share, sessions that
together outgrew the pool waited for blocks that nobody gave back and all of them stalled (24 sessions
on an H100 after about 50 s). These tests run sessions that together need more than the pool and check
that every one keeps going within its share (window on), ends with RESOURCE_EXHAUSTED (window off), or
is refused at open when its share could not hold it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from services.common.errors import RESOURCE_EXHAUSTED
from services.common.grpc_server import ServeOptions
from services.common.pb import common_pb2, thinker_pb2, thinker_pb2_grpc
from services.common.pcm import pcm_from_float
from services.thinker.backend import ThinkerBackend, build_backend
from services.thinker.duplex import DuplexSession
from services.thinker.duplex_window import MIN_ROOM_TOKENS, DuplexWindow
from services.thinker.engine import EngineConfig, ThinkerEngine
from services.thinker.server import make_server

torch.set_num_threads(1)
MAX_CONTEXT = 2048
KIB_PER_TOKEN = 1  # the tiny thinker's K and V of one token, all layers (fp32)


@pytest.fixture(scope="module")
def backend(tiny_ckpt: Path):
    b = build_backend(str(tiny_ckpt), "cpu", "float32", EngineConfig(kv_budget_bytes=16 << 20))
    yield b
    b.executor.shutdown(wait=False)


def _small(backend: ThinkerBackend, pool_tokens: int, window: DuplexWindow | None) -> ThinkerBackend:
    engine = ThinkerEngine(
        backend.engine.runner.llm,
        EngineConfig(max_context=MAX_CONTEXT, kv_budget_bytes=pool_tokens * KIB_PER_TOKEN << 10),
        "cpu",
    )
    engine.start()
    return dataclasses.replace(backend, engine=engine, duplex_window=window)


def _open(session: str) -> thinker_pb2.ThinkerRequest:
    ident = common_pb2.Identity(session_id=session, request_id=f"r-{session}")
    return thinker_pb2.ThinkerRequest(
        open=thinker_pb2.ThinkerOpen(
            id=ident,
            mode=common_pb2.STREAM_MODE_DUPLEX,
            sampling=thinker_pb2.SamplingParams(temperature=0.0),
            hidden_dtype=common_pb2.DTYPE_FLOAT32,
            force_listen_units=1000,
        )
    )


def _unit(session: str, seq: int) -> thinker_pb2.ThinkerRequest:
    wave = (0.1 * np.random.default_rng(seq).standard_normal(16000)).astype(np.float32)
    ident = common_pb2.Identity(session_id=session, unit_seq=seq)
    return thinker_pb2.ThinkerRequest(
        unit=thinker_pb2.ThinkerUnit(id=ident, audio=pcm_from_float(wave, 16000))
    )


END = thinker_pb2.ThinkerRequest(control=common_pb2.Control(end=common_pb2.End()))


async def _sessions(
    backend: ThinkerBackend, streams: list[AsyncIterator[thinker_pb2.ThinkerRequest]]
) -> list[list[thinker_pb2.ThinkerResponse]]:
    """Several duplex streams at once through one real server; each stream's responses."""
    server = make_server(backend, ServeOptions(host="127.0.0.1", port=0, metrics_port=0))
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = thinker_pb2_grpc.ThinkerServiceStub(ch)

            async def run(
                source: AsyncIterator[thinker_pb2.ThinkerRequest],
            ) -> list[thinker_pb2.ThinkerResponse]:
                return [r async for r in stub.Generate(source, timeout=90)]

            return await asyncio.gather(*(run(s) for s in streams))
    finally:
        await server.stop(grace=0.5)


async def _paced(session: str, units: int) -> AsyncIterator[thinker_pb2.ThinkerRequest]:
    """A session's open, ``units`` units a few milliseconds apart (so the sessions interleave), End."""
    yield _open(session)
    for i in range(units):
        yield _unit(session, i)
        await asyncio.sleep(0.005)
    yield END


def _prefix_tokens(backend: ThinkerBackend) -> int:
    return len(DuplexSession(backend, _open("probe").open).prefix_work().token_ids)


def _errors(got: list[thinker_pb2.ThinkerResponse]) -> list[common_pb2.StageErrorProto]:  # type: ignore[name-defined]
    return [r.error for r in got if r.HasField("error")]


def test_window_lowers_to_the_share() -> None:
    window = DuplexWindow(high=8000, low=6000)
    assert window.within(9000) is window
    assert window.within(2400) == DuplexWindow(high=2400, low=1800)
    assert window.within(0).high >= 2 and window.within(0).low >= 1


def test_the_share_counts_open_sessions(backend: ThinkerBackend) -> None:
    engine = _small(backend, 2000, None).engine
    try:
        capacity, block = engine.cache.capacity_tokens, engine.layout.block_size
        assert engine.session_share() == capacity // 1 - block
        a = engine.open(lambda *_: None, persistent=True)
        engine.open(lambda *_: None)  # a chat request is not a session
        b = engine.open(lambda *_: None, persistent=True)
        assert engine.open_sessions == 2 and engine.session_share() == capacity // 3 - block
        engine.close(a)
        engine.close(a)  # a second close of the same sequence changes nothing
        assert engine.open_sessions == 1
        engine.close(b)
        assert engine.open_sessions == 0
    finally:
        engine.shutdown()


def test_sessions_that_outgrow_the_pool_keep_going_within_their_share(backend: ThinkerBackend) -> None:
    """Three sessions of 60 units would hold about 2,500 tokens together, more than the 2,032-token pool;
    with the window's marks lowered to the share each trims and every unit is answered."""
    small = _small(backend, 2032, DuplexWindow(high=1900, low=1400).validate(MAX_CONTEXT))
    engine = small.engine
    share = engine.cache.capacity_tokens // 4 - engine.layout.block_size
    try:
        got = asyncio.run(_sessions(small, [_paced(f"s{i}", 60) for i in range(3)]))
        for responses in got:
            assert not _errors(responses), [e.message for e in _errors(responses)]
            units = [r.unit for r in responses if r.HasField("unit")]
            assert [u.id.unit_seq for u in units] == list(range(60))
            assert max(u.context_tokens for u in units) <= share
            done = responses[-1].done
            assert done.usage.extra["window_trims"] >= 1
            assert done.usage.total_tokens > share  # without the trims it would not have fit
        assert engine.open_sessions == 0
    finally:
        engine.shutdown()


def test_without_a_window_a_session_past_its_share_ends_with_resource_exhausted(
    backend: ThinkerBackend,
) -> None:
    small = _small(backend, 1008, None)
    engine = small.engine
    share = engine.cache.capacity_tokens // 2 - engine.layout.block_size
    try:
        [got] = asyncio.run(_sessions(small, [_paced("w", 80)]))
        [err] = _errors(got)
        assert err.code == RESOURCE_EXHAUSTED and err.param == "unit"
        assert "share of the thinker's KV cache" in err.message and "--duplex-window basic" in err.message
        units = [r.unit for r in got if r.HasField("unit")]
        assert 10 < len(units) < 80 and all(u.context_tokens <= share for u in units)
    finally:
        engine.shutdown()


def test_a_session_the_pool_cannot_hold_is_refused_at_open(backend: ThinkerBackend) -> None:
    """Sessions are admitted while an equal share (one share kept free) holds the prefix plus
    MIN_ROOM_TOKENS; the next one is refused with RESOURCE_EXHAUSTED, and the open ones go on."""
    small = _small(backend, 2032, DuplexWindow(high=1900, low=1400).validate(MAX_CONTEXT))
    engine = small.engine
    capacity, block = engine.cache.capacity_tokens, engine.layout.block_size
    need = _prefix_tokens(small) + MIN_ROOM_TOKENS
    fits = max(n for n in range(1, 64) if capacity // (n + 1) - block >= need)
    release = asyncio.Event()

    async def held(session: str) -> AsyncIterator[thinker_pb2.ThinkerRequest]:
        yield _open(session)
        yield _unit(session, 0)
        await release.wait()
        yield END

    async def scenario() -> list[list[thinker_pb2.ThinkerResponse]]:
        async def late() -> AsyncIterator[thinker_pb2.ThinkerRequest]:
            while engine.open_sessions < fits:  # every admitted session is open first
                await asyncio.sleep(0.01)
            yield _open("late")
            await asyncio.sleep(0.5)
            release.set()
            yield END

        return await _sessions(small, [held(f"h{i}") for i in range(fits)] + [late()])

    try:
        got = asyncio.run(scenario())
        for responses in got[:-1]:
            assert not _errors(responses) and responses[-1].HasField("done")
        [err] = _errors(got[-1])
        assert err.code == RESOURCE_EXHAUSTED and err.param == "session"
        assert f"with {fits + 1} open" in err.message
        assert engine.open_sessions == 0
    finally:
        engine.shutdown()
