"""Duplex mode of the thinker stage (tiny checkpoint, CPU): one decision per 1 s unit, KV growth per unit,
speech span hand-off, interrupts with epoch fencing, the context limit, and the decision policy itself."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from services.common.errors import CONTEXT_LENGTH_EXCEEDED
from services.common.grpc_server import ServeOptions
from services.common.pb import common_pb2, thinker_pb2, thinker_pb2_grpc
from services.common.pcm import pcm_from_float
from services.common.tensors import tensor_from_proto
from services.thinker.backend import build_backend
from services.thinker.duplex import (
    CHUNK_EOS,
    LISTEN,
    TTS_BOS,
    TTS_EOS,
    TURN_EOS,
    DuplexPolicy,
    DuplexSampling,
    PolicyState,
    select_span,
)
from services.thinker.engine import EngineConfig, ThinkerEngine
from services.thinker.server import make_server

torch.set_num_threads(1)
UNIT_OPEN, UNIT_CLOSE = 151683, 151684


@pytest.fixture(scope="module")
def backend(tiny_ckpt: Path):
    cfg = EngineConfig(kv_budget_bytes=16 << 20, max_step_tokens=128)
    b = build_backend(str(tiny_ckpt), "cpu", "float32", cfg)
    b.engine.start()
    yield b
    b.engine.shutdown()
    b.executor.shutdown(wait=False)


def unit(seq: int, epoch: int = 0, seconds: float = 1.0) -> thinker_pb2.ThinkerRequest:
    rng = np.random.default_rng(seq)
    wave = (0.1 * rng.standard_normal(int(16000 * seconds))).astype(np.float32)
    ident = common_pb2.Identity(session_id="d-1", epoch=epoch, unit_seq=seq)
    return thinker_pb2.ThinkerRequest(
        unit=thinker_pb2.ThinkerUnit(id=ident, audio=pcm_from_float(wave, 16000))
    )


def duplex_open(**kw: object) -> thinker_pb2.ThinkerRequest:
    greedy = thinker_pb2.SamplingParams(temperature=0.0)
    ident = common_pb2.Identity(session_id="d-1", request_id="r-d")
    return thinker_pb2.ThinkerRequest(
        open=thinker_pb2.ThinkerOpen(
            id=ident,
            mode=common_pb2.STREAM_MODE_DUPLEX,
            sampling=greedy,
            hidden_dtype=common_pb2.DTYPE_FLOAT32,
            **({"want_speech": True} | kw),
        )
    )


END = thinker_pb2.ThinkerRequest(control=common_pb2.Control(end=common_pb2.End()))


async def _session(
    backend,  # noqa: ANN001
    requests: list[thinker_pb2.ThinkerRequest] | AsyncIterator[thinker_pb2.ThinkerRequest],
) -> list[thinker_pb2.ThinkerResponse]:
    """One duplex stream through a real server; ``requests`` is a list, or a generator that paces them."""
    server = make_server(backend, ServeOptions(host="127.0.0.1", port=0, metrics_port=0))
    port = await server.start()

    async def gen() -> AsyncIterator[thinker_pb2.ThinkerRequest]:
        for r in requests:  # type: ignore[union-attr]
            yield r

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = thinker_pb2_grpc.ThinkerServiceStub(ch)
            source = gen() if isinstance(requests, list) else requests
            return [r async for r in stub.Generate(source, timeout=60)]
    finally:
        await server.stop(grace=0.5)


def test_listen_units_one_decision_each_and_kv_growth(backend) -> None:  # noqa: ANN001
    reqs = (
        [duplex_open(force_listen_units=5, instructions="Stay quiet.")] + [unit(i) for i in range(5)] + [END]
    )
    got = asyncio.run(_session(backend, reqs))
    units = [r.unit for r in got if r.HasField("unit")]
    assert [u.id.unit_seq for u in units] == [0, 1, 2, 3, 4]
    assert all(u.decision == thinker_pb2.UNIT_DECISION_LISTEN for u in units)
    assert all(list(u.token_ids) == [LISTEN] for u in units)
    assert not any(r.HasField("speech") for r in got)
    ctx = [u.context_tokens for u in units]
    # Unit 1 adds <unit> + 10 audio rows; later units also re-inject <|listen|> </unit>: 13 per unit.
    assert [b - a for a, b in zip(ctx, ctx[1:], strict=False)] == [13, 13, 13, 13]
    prefix = backend.processor.encode_text("<|im_start|>system\nStay quiet.<|im_end|>")
    assert ctx[0] == len(prefix) + 11
    assert got[-1].HasField("done") and got[-1].done.usage.extra["units"] == 5
    assert backend.engine.kv_used_bytes == 0 or _wait_free(backend.engine)


def _wait_free(engine: ThinkerEngine) -> bool:
    import time

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if engine.kv_used_bytes == 0:
            return True
        time.sleep(0.02)
    return False


def test_forced_speak_units_hand_off_aligned_spans(backend) -> None:  # noqa: ANN001
    reqs = [duplex_open(force_speak=True)] + [unit(i) for i in range(3)] + [END]
    got = asyncio.run(_session(backend, reqs))
    assert not any(r.HasField("error") for r in got), got
    units = [r.unit for r in got if r.HasField("unit")]
    speech = [r.speech for r in got if r.HasField("speech")]
    assert len(units) == 3 and all(u.decision == thinker_pb2.UNIT_DECISION_SPEAK for u in units)
    prev_ctx = None
    for u in units:
        gen = list(u.token_ids)
        assert 1 <= len(gen) <= 19
        span = [gen[k] for k in select_span(gen)]
        chunk = next((c for c in speech if c.id.unit_seq == u.id.unit_seq), None)
        if span:
            assert chunk is not None and list(chunk.token_ids) == span
            rows = tensor_from_proto(chunk.hidden)
            assert rows.shape == (len(span), backend.hidden_size) and chunk.segment_end
            assert chunk.text == u.transcript
        # KV growth: re-injected terminator + </unit> + <unit> + 10 audio + every fed generated token
        # (all but an unfed terminator; a unit capped at 19 feeds all 19 and re-injects <|chunk_eos|>).
        fed = len(gen) - (1 if gen[-1] in (LISTEN, CHUNK_EOS, 151721) else 0)
        if prev_ctx is not None:
            assert u.context_tokens - prev_ctx == 13 + fed
        prev_ctx = u.context_tokens
    assert speech and speech[0].turn_start

    # Without want_speech the decisions and transcripts are the same, but no hidden rows travel.
    quiet = asyncio.run(_session(backend, [duplex_open(force_speak=True, want_speech=False), unit(0), END]))
    assert not any(r.HasField("speech") for r in quiet)
    first = next(r.unit for r in quiet if r.HasField("unit"))
    assert list(first.token_ids) == list(units[0].token_ids) and first.transcript == units[0].transcript


def test_unit_budget_ends_the_turn_and_note_enters_the_context(backend) -> None:  # noqa: ANN001
    """Per-response options on a unit: ``max_output_tokens`` ends the model's turn with ``<|turn_eos|>``
    after that many spoken tokens (``max_tokens_reached``), and ``instructions`` enter the context as a
    system note before the unit."""
    budgeted = unit(0)
    budgeted.unit.max_output_tokens = 3
    got = asyncio.run(_session(backend, [duplex_open(force_speak=True), budgeted, unit(1), END]))
    assert not any(r.HasField("error") for r in got), got
    first = next(r.unit for r in got if r.HasField("unit"))
    gen = list(first.token_ids)
    span = [gen[k] for k in select_span(gen)]
    assert span[-1] == TURN_EOS and len([t for t in span if t != TURN_EOS]) == 3, gen
    assert first.turn_end and first.max_tokens_reached
    chunk = next(r.speech for r in got if r.HasField("speech"))
    assert chunk.turn_end and list(chunk.token_ids) == span
    # Without the budget the same greedy unit speaks past three tokens and does not end its turn.
    free = asyncio.run(_session(backend, [duplex_open(force_speak=True), unit(0), END]))
    free_unit = next(r.unit for r in free if r.HasField("unit"))
    assert len(select_span(list(free_unit.token_ids))) > 4 and not free_unit.max_tokens_reached

    noted = unit(1)
    noted.unit.instructions = "Answer in one word."
    plain = asyncio.run(_session(backend, [duplex_open(force_listen_units=2), unit(0), unit(1), END]))
    with_note = asyncio.run(_session(backend, [duplex_open(force_listen_units=2), unit(0), noted, END]))
    ctx_plain = [r.unit.context_tokens for r in plain if r.HasField("unit")]
    ctx_note = [r.unit.context_tokens for r in with_note if r.HasField("unit")]
    note = backend.processor.encode_text("<|im_start|>system\nAnswer in one word.<|im_end|>\n")
    assert ctx_note[0] == ctx_plain[0] and ctx_note[1] - ctx_plain[1] == len(note)


def test_interrupt_drops_stale_work_and_acks(backend) -> None:  # noqa: ANN001
    interrupt = thinker_pb2.ThinkerRequest(
        control=common_pb2.Control(interrupt=common_pb2.Interrupt(new_epoch=1, reason="barge-in"))
    )
    reqs = [
        duplex_open(force_speak=True),
        unit(0),
        unit(1),
        interrupt,
        unit(2, epoch=0),
        unit(3, epoch=1),
        END,
    ]
    got = asyncio.run(_session(backend, reqs))
    kinds = [r.WhichOneof("kind") for r in got]
    assert "error" not in kinds
    ack = got[kinds.index("interrupt_ack")].interrupt_ack
    assert ack.new_epoch == 1
    units = [r.unit for r in got if r.HasField("unit")]
    seqs = [u.id.unit_seq for u in units]
    assert 2 not in seqs  # sent with the old epoch after the interrupt: dropped
    assert seqs[-1] == 3 and units[-1].id.epoch == 1
    after = got[kinds.index("interrupt_ack") + 1 :]
    assert all(r.WhichOneof("kind") == "done" or _epoch(r) == 1 for r in after)


def _epoch(r: thinker_pb2.ThinkerResponse) -> int:
    return getattr(r, r.WhichOneof("kind")).id.epoch


def test_context_limit_ends_session_cleanly(backend) -> None:  # noqa: ANN001
    small = ThinkerEngine(
        backend.engine.runner.llm, EngineConfig(max_context=70, kv_budget_bytes=4 << 20), "cpu"
    )
    small.start()
    try:
        b = dataclasses.replace(backend, engine=small)
        got = asyncio.run(
            _session(b, [duplex_open(force_listen_units=100)] + [unit(i) for i in range(6)] + [END])
        )
        assert got[-1].HasField("error"), [r.WhichOneof("kind") for r in got]
        assert got[-1].error.code == CONTEXT_LENGTH_EXCEEDED and got[-1].error.param == "unit"
        units = [r.unit for r in got if r.HasField("unit")]
        assert 1 <= len(units) < 6 and all(u.context_tokens <= 70 for u in units)
        assert _wait_free(small)
    finally:
        small.shutdown()


def test_sliding_window_keeps_a_long_session_going(backend) -> None:  # noqa: ANN001
    """``--duplex-window basic``: a session that would pass the context limit trims to the prefix plus its
    newest whole units (their audio rows re-fed exactly) and carries on; without it the session ends."""
    from services.thinker.duplex_window import DuplexWindow

    small = ThinkerEngine(
        backend.engine.runner.llm, EngineConfig(max_context=120, kv_budget_bytes=4 << 20), "cpu"
    )
    small.start()
    submitted: list = []
    plain_submit = small.submit
    small.submit = lambda seq, work: (submitted.append(work), plain_submit(seq, work))[1]  # type: ignore[method-assign]
    try:
        b = dataclasses.replace(
            backend, engine=small, duplex_window=DuplexWindow(high=110, low=70).validate(120)
        )
        got = asyncio.run(
            _session(b, [duplex_open(force_listen_units=100)] + [unit(i) for i in range(14)] + [END])
        )
        assert not [r.error.message for r in got if r.HasField("error")]
        units = [r.unit for r in got if r.HasField("unit")]
        assert [u.id.unit_seq for u in units] == list(range(14))
        assert all(u.context_tokens <= 110 for u in units)
        is_trim = [isinstance(w.tag, tuple) and w.tag[0] == "trim" for w in submitted]
        trims = [(i, w) for i, w in enumerate(submitted) if is_trim[i]]
        assert len(trims) >= 2 and got[-1].done.usage.extra["window_trims"] == len(trims)
        prefix = submitted[0]
        unit_works = [(i, w) for i, w in enumerate(submitted) if i > 0 and not is_trim[i]]
        for at, trim in trims:
            assert trim.token_ids[: len(prefix.token_ids)] == prefix.token_ids
            assert len(trim.token_ids) <= 70
            # The tail is the newest whole units, fed again with their own audio rows.
            before = [w for i, w in unit_works if i < at]
            pos, k = len(trim.token_ids), len(before)
            while pos > len(prefix.token_ids):
                k -= 1
                n = len(before[k].token_ids)
                pos -= n
                assert trim.token_ids[pos : pos + n] == before[k].token_ids
                assert torch.equal(trim.embeds[pos : pos + n], before[k].embeds)
            assert pos == len(prefix.token_ids) and 0 < k < len(before)
        total = got[-1].done.usage.total_tokens
        assert total == len(prefix.token_ids) + sum(len(w.token_ids) for _, w in unit_works)
        assert _wait_free(small)
    finally:
        small.shutdown()

    with pytest.raises(Exception, match="high"):
        DuplexWindow(high=130, low=70).validate(120)


def test_interrupt_while_a_window_trim_prefills(backend) -> None:  # noqa: ANN001
    """A barge-in that lands while a trim's prefill is in flight drops the unit waiting behind it (counted in
    the ack), lets the trimmed context finish prefilling (it is context, not output) and serves the new
    epoch's units on the trimmed sequence; nothing of the old epoch is answered after the ack."""
    from services.thinker.duplex_window import DuplexWindow

    small = ThinkerEngine(
        backend.engine.runner.llm, EngineConfig(max_context=120, kv_budget_bytes=4 << 20), "cpu"
    )
    small.start()
    submitted: list = []
    held: list = []  # the trim's submit, released only after the interrupt went in
    plain_submit = small.submit

    trim_seen = asyncio.Event()

    def submit(seq, work) -> None:  # noqa: ANN001
        submitted.append(work)
        if isinstance(work.tag, tuple) and work.tag[0] == "trim" and not held:
            held.append((seq, work))
            trim_seen.set()  # called on the server's event loop, as the gRPC handler submits there
            return
        plain_submit(seq, work)

    small.submit = submit  # type: ignore[method-assign]
    interrupt = thinker_pb2.ThinkerRequest(
        control=common_pb2.Control(interrupt=common_pb2.Interrupt(new_epoch=1, reason="barge-in"))
    )

    async def paced() -> AsyncIterator[thinker_pb2.ThinkerRequest]:
        yield duplex_open(force_listen_units=100)
        for i in range(12):
            yield unit(i)
        await asyncio.wait_for(trim_seen.wait(), 60)
        yield interrupt
        await asyncio.sleep(0.3)  # the server applies the interrupt while the trim is still held
        seq, work = held[0]
        asyncio.get_running_loop().call_soon(plain_submit, seq, work)
        yield unit(100, epoch=1)
        yield unit(101, epoch=1)
        yield END

    b = dataclasses.replace(backend, engine=small, duplex_window=DuplexWindow(high=110, low=70).validate(120))
    try:
        got = asyncio.run(_session(b, paced()))
        assert not [r.error.message for r in got if r.HasField("error")]
        kinds = [r.WhichOneof("kind") for r in got]
        ack_at = kinds.index("interrupt_ack")
        assert got[ack_at].interrupt_ack.new_epoch == 1 and got[ack_at].interrupt_ack.dropped_items >= 1
        trim_at = next(i for i, w in enumerate(submitted) if w.tag[0] == "trim")
        fed_before = [w.tag[0] for w in submitted[1:trim_at]]
        fed_after = [w.tag[0] for w in submitted[trim_at + 1 :]]
        assert fed_after == [100, 101]  # the unit behind the trim never reached the engine
        answered = [r.unit.id.unit_seq for r in got if r.HasField("unit")]
        assert answered == fed_before + [100, 101]
        assert all(_epoch(r) == 1 for r in got[ack_at + 1 :] if r.WhichOneof("kind") != "done")
        usage = got[-1].done.usage
        assert usage.extra["window_trims"] == 1
        assert usage.total_tokens == sum(len(w.token_ids) for i, w in enumerate(submitted) if i != trim_at)
        assert _wait_free(small)
    finally:
        small.shutdown()


# ------------------------------------------------------------------------------------- policy units
def _policy(state: PolicyState, **kw: object) -> DuplexPolicy:
    forbidden = torch.zeros(151748, dtype=torch.bool)
    forbidden[500] = True
    args = {"force_listen": False, "force_speak": False} | kw
    return DuplexPolicy(DuplexSampling(temperature=0.0), state, forbidden, **args)  # type: ignore[arg-type]


def test_policy_rules() -> None:
    logits = torch.zeros(151748)
    logits[LISTEN] = 5.0
    state = PolicyState(turn_ended=False)
    # A listen while the model's turn is open becomes <|tts_bos|>.
    assert _policy(state).choose(logits.clone(), [], 0) == TTS_BOS
    state = PolicyState(turn_ended=True)
    assert _policy(state).choose(logits.clone(), [], 0) == LISTEN
    # Forced speak masks listen for the decision token; forced listen never samples.
    assert _policy(PolicyState(), force_speak=True).choose(logits.clone(), [], 0) not in (LISTEN, CHUNK_EOS)
    assert _policy(PolicyState(), force_listen=True).choose(torch.zeros(151748), [], 0) == LISTEN
    # The raw first draw detects <|chunk_eos|>; forbidden ids are never drawn.
    eos = torch.zeros(151748)
    eos[CHUNK_EOS] = 9.0
    assert _policy(PolicyState()).choose(eos, [], 3) == CHUNK_EOS
    bad = torch.zeros(151748)
    bad[500] = 9.0
    assert _policy(PolicyState()).choose(bad, [], 1) != 500
    # <|turn_eos|> closes the model turn; the 19-token cap ends the unit with "length".
    st = PolicyState(turn_ended=False)
    te = torch.zeros(151748)
    te[TURN_EOS] = 9.0
    p = _policy(st)
    assert p.choose(te, [], 2) == TURN_EOS and st.turn_ended
    assert p.finish_reason(LISTEN, 3) == "stop" and p.finish_reason(42, 19) == "length"


def test_span_selection() -> None:
    assert select_span([LISTEN]) == []
    assert select_span([TTS_BOS, 10, 11, CHUNK_EOS]) == [1, 2]
    assert select_span([10, 11, TURN_EOS, 12, LISTEN]) == [1, 2]  # turn_eos inclusive, rest dropped
    assert select_span([10, 11, TTS_BOS, 12, TTS_EOS, 13]) == [3]  # restarts after an inner tts_bos


def test_a_closed_session_drops_its_whisper_cache_and_the_auto_pool_leaves_room_for_one(
    backend,  # noqa: ANN001
    tiny_ckpt: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Closing a duplex stream releases its Whisper buffer at once (not when the last reference goes), and
    an automatically sized KV pool keeps a Whisper cache plus SEQUENCE_HEADROOM_BYTES per sequence (+2)
    outside it."""
    from services.thinker.kv_cache import SEQUENCE_HEADROOM_BYTES
    from services.thinker.model.thinker import ThinkerModel

    states = []
    new_stream = ThinkerModel.new_audio_stream

    def record(self: ThinkerModel):  # noqa: ANN202
        states.append(new_stream(self))
        return states[-1]

    monkeypatch.setattr(ThinkerModel, "new_audio_stream", record)
    reqs = [duplex_open(force_listen_units=2)] + [unit(i) for i in range(2)] + [END]
    got = asyncio.run(_session(backend, reqs))
    assert got[-1].HasField("done") and len(states) == 1
    assert states[0].released and states[0].cache is None and states[0].frames == 0

    cfg = EngineConfig(max_num_seqs=3)
    auto = build_backend(str(tiny_ckpt), "cpu", "float32", cfg)
    try:
        assert cfg.reserve_bytes == 5 * (auto.model.audio_stream_bytes() + SEQUENCE_HEADROOM_BYTES)
    finally:
        auto.executor.shutdown(wait=False)
