"""Duplex encode-ahead and the turn lane's unit roles (tiny checkpoint, CPU fp32, a real thinker server).

Encode-ahead: while the engine decides unit n, the stream already encodes unit n+1 (its audio does not
depend on unit n's decision; its token layout does, so it is assembled only after). It must change
nothing the model sees: the same session gives the same tokens, decisions, context sizes and speech rows
with it on and off. The roles: ``force_listen`` decides a unit as listen even when it asks for a
response; ``continue_turn`` lets the model decide only while its turn is open (a unit after a listen is
decided as listen) and is otherwise a plain unit.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from services.common.grpc_server import ServeOptions
from services.common.pb import common_pb2, thinker_pb2, thinker_pb2_grpc
from services.common.pcm import pcm_from_float
from services.common.tensors import tensor_from_proto
from services.thinker import duplex_stream
from services.thinker.backend import build_backend
from services.thinker.duplex import LISTEN, DuplexSession
from services.thinker.engine import EngineConfig
from services.thinker.server import make_server

torch.set_num_threads(1)
PREPARE_UNIT = DuplexSession.prepare_unit
END = thinker_pb2.ThinkerRequest(control=common_pb2.Control(end=common_pb2.End()))


@pytest.fixture(scope="module")
def backend(tiny_ckpt: Path):
    # No prefix cache: the second arm would reuse the first arm's session prefix, whose prefill chunks then
    # split differently (same tokens, hidden rows not bit-identical); this module compares the two arms.
    cfg = EngineConfig(kv_budget_bytes=16 << 20, max_step_tokens=128, prefix_caching=False)
    b = build_backend(str(tiny_ckpt), "cpu", "float32", cfg)
    b.engine.start()
    yield b
    b.engine.shutdown()
    b.executor.shutdown(wait=False)


def _unit(seq: int, **flags: bool) -> thinker_pb2.ThinkerRequest:
    rng = np.random.default_rng(100 + seq)
    wave = (0.1 * rng.standard_normal(16000)).astype(np.float32)
    ident = common_pb2.Identity(session_id="ahead", epoch=0, unit_seq=seq)
    return thinker_pb2.ThinkerRequest(
        unit=thinker_pb2.ThinkerUnit(id=ident, audio=pcm_from_float(wave, 16000), **flags)
    )


def _open() -> thinker_pb2.ThinkerRequest:
    return thinker_pb2.ThinkerRequest(
        open=thinker_pb2.ThinkerOpen(
            id=common_pb2.Identity(session_id="ahead", request_id="r-ahead"),
            mode=common_pb2.STREAM_MODE_DUPLEX,
            sampling=thinker_pb2.SamplingParams(temperature=0.7, seed=1234),
            hidden_dtype=common_pb2.DTYPE_FLOAT32,
            want_speech=True,
        )
    )


async def _run(backend, requests: list[thinker_pb2.ThinkerRequest]) -> list[thinker_pb2.ThinkerResponse]:  # noqa: ANN001
    server = make_server(backend, ServeOptions(host="127.0.0.1", port=0, metrics_port=0))
    port = await server.start()

    async def gen():  # noqa: ANN202
        for r in requests:
            yield r

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = thinker_pb2_grpc.ThinkerServiceStub(ch)
            return [r async for r in stub.Generate(gen(), timeout=120)]
    finally:
        await server.stop(grace=0.5)


def _session(backend, monkeypatch, ahead: bool, requests) -> tuple[list, list[int]]:  # noqa: ANN001
    """Responses of one session, and the session's decided-unit count at each unit's encode start."""
    monkeypatch.setattr(duplex_stream, "ENCODE_AHEAD", ahead)
    done_at_encode: list[int] = []

    def spy(self: DuplexSession, unit: thinker_pb2.ThinkerUnit):  # noqa: ANN202
        done_at_encode.append(self.units_done)
        return PREPARE_UNIT(self, unit)

    monkeypatch.setattr(DuplexSession, "prepare_unit", spy)
    return asyncio.run(_run(backend, requests)), done_at_encode


def _units(got: list) -> list[tuple]:  # noqa: ANN001
    return [
        (u.id.unit_seq, u.decision, list(u.token_ids), u.turn_end, u.context_tokens)
        for u in (r.unit for r in got if r.HasField("unit"))
    ]


def _phase_count(phase: str) -> float:
    return REGISTRY.get_sample_value("minicpmo_thinker_duplex_unit_seconds_count", {"phase": phase}) or 0.0


def _speech(got: list) -> list[tuple]:  # noqa: ANN001
    return [
        (s.id.unit_seq, list(s.token_ids), tensor_from_proto(s.hidden))
        for s in (r.speech for r in got if r.HasField("speech"))
    ]


def test_encode_ahead_changes_nothing_the_model_sees(backend, monkeypatch) -> None:  # noqa: ANN001
    """A sampled session with speaking units: identical results with encode-ahead on and off, and with it
    on each unit's encode really began before the unit in front of it was decided."""
    requests = [_open(), *(_unit(i, request_response=i in (1, 4)) for i in range(7)), END]
    counts = {
        phase: _phase_count(phase) for phase in ("behind", "engine", "request_behind", "request_engine")
    }
    off, done_off = _session(backend, monkeypatch, False, requests)
    on, done_on = _session(backend, monkeypatch, True, requests)
    # The unit split: every unit waits "behind" and runs in the engine once; the two that ask for a
    # response are counted again apart (their time is on the way to the first audio).
    runs = {phase: _phase_count(phase) - n for phase, n in counts.items()}
    assert runs == {"behind": 14, "engine": 14, "request_behind": 4, "request_engine": 4}
    assert len(_units(off)) == 7
    assert _units(on) == _units(off)
    speech_off, speech_on = _speech(off), _speech(on)
    assert speech_off, "the forced-speak units hand speech over"
    assert [(s, t) for s, t, _ in speech_on] == [(s, t) for s, t, _ in speech_off]
    for (_, _, a), (_, _, b) in zip(speech_on, speech_off, strict=True):
        assert torch.equal(a, b)
    assert done_off == list(range(7))  # without it a unit is encoded only once the one before is decided
    # With it, unit n is encoded while unit n-1 is still in the engine (the first while the prefix runs).
    assert done_on == [0, *range(6)]


def _roles(backend, **last: bool) -> list[tuple]:  # noqa: ANN001
    """A session of four units: a forced-listen request, a continuation, a request, then unit 3 (``last``)."""
    requests = [
        _open(),
        _unit(0, request_response=True, force_listen=True),
        _unit(1, continue_turn=True),
        _unit(2, request_response=True),
        _unit(3, **last),
        END,
    ]
    return _units(asyncio.run(_run(backend, requests)))


def test_force_listen_and_continue_turn(backend, monkeypatch) -> None:  # noqa: ANN001
    """force_listen beats a response request; continue_turn after a listen is a listen, after a unit that
    spoke and left its turn open it is decided like a plain unit."""
    monkeypatch.setattr(duplex_stream, "ENCODE_AHEAD", True)
    units = _roles(backend, continue_turn=True)
    assert [u[0] for u in units] == [0, 1, 2, 3]
    listen = thinker_pb2.UNIT_DECISION_LISTEN
    assert units[0][1] == listen and units[0][2] == [LISTEN]
    assert units[1][1] == listen and units[1][2] == [LISTEN]
    assert units[2][1] == thinker_pb2.UNIT_DECISION_SPEAK
    if units[2][3]:  # unit 2 ended the model's turn: the continuation is a listen
        assert units[3][2] == [LISTEN]
    else:  # the same session with unit 3 plain decides unit 3 the same way
        assert units[3] == _roles(backend)[3]
