"""The talker's graphed batched prefill (services/talker/runner.py), on the CPU with a host-side replay.

The graph path pads every prefill to a (streams, rows, attention length) bucket and replays one captured
function per bucket from static buffers; these tests hold it to the eager prefill: the same logits, the
same K/V in every slot, the same lengths, the same frames through the engine, and a start-up warm-up that
captures every bucket without touching any slot.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.checkpoint import Checkpoint
from services.common.cuda_graphs import SharedBuffers
from services.talker.engine import TalkerEngine
from services.talker.model.tts import MiniCPMTTS
from services.talker.runner import MIN_LENGTH_BUCKET, PREFILL_GRAPH_KEYS, PREFILL_WIDTHS, TalkerRunner
from tests.graph_emulation import emulated_capture, recording_capture
from tests.test_talker_engine import Sink, cond_input


@pytest.fixture(scope="module")
def model(tiny_ckpt: Path) -> MiniCPMTTS:
    return MiniCPMTTS.from_checkpoint(Checkpoint(tiny_ckpt))


def _rows(model: MiniCPMTTS, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, model.cfg.hidden_size, generator=gen).to(model.dtype)


def _assert_same_state(a: TalkerRunner, b: TalkerRunner) -> None:
    """Same lengths, and the same K/V at every position a slot holds (scratch and stale columns aside)."""
    assert a.cache.lengths == b.cache.lengths
    for layer in range(len(a.layers)):
        for slot, length in enumerate(a.cache.lengths):
            torch.testing.assert_close(a.cache.k[layer][slot, :length], b.cache.k[layer][slot, :length])
            torch.testing.assert_close(a.cache.v[layer][slot, :length], b.cache.v[layer][slot, :length])


def test_graphed_prefill_equals_eager_prefill(model: MiniCPMTTS) -> None:
    """Batches of 1–3 streams, conditions of 3–40 rows, streams starting at 0 or behind earlier rows: the
    replayed bucket gives the eager prefill's logits and K/V. A batch that fits no bucket (a condition
    longer than the widest, or more key rows than ``PREFILL_GRAPH_KEYS``) prefills eagerly and captures
    nothing."""
    eager = TalkerRunner(model, num_slots=4, use_cuda_graphs=False)
    graphed = TalkerRunner(model, num_slots=4, use_cuda_graphs=False)
    calls: list = []
    graphed.enable_prefill_graphs(capture=recording_capture(calls, emulated_capture))
    assert graphed.prefill_graphs is not None and graphed.prefill_graph_batch == 4
    batches = [
        [(0, _rows(model, 5, 1)), (1, _rows(model, 12, 2)), (2, _rows(model, 20, 3))],  # bucket (4, 32, 64)
        [(1, _rows(model, 40, 4))],  # starts at 12: bucket (1, 64, 64)
        [(2, _rows(model, 3, 5)), (0, _rows(model, 7, 6))],  # bucket (2, 16, 64)
        [(3, _rows(model, 16, 7)), (1, _rows(model, 30, 8))],  # 1 ends at 82: bucket (2, 32, 128)
        [(3, _rows(model, PREFILL_WIDTHS[-1] + 1, 9))],  # wider than every bucket: eager
        [(0, _rows(model, 2100, 10))],  # eager as well; slot 0 now ends past 2048
        [
            (0, _rows(model, 5, 11)),
            (1, _rows(model, 6, 12)),
            (2, _rows(model, 7, 13)),
        ],  # 4 x 4096 keys: eager
    ]
    assert 4 * 4096 > PREFILL_GRAPH_KEYS >= 2 * 4096
    for items in batches:
        torch.testing.assert_close(graphed.prefill_batch(items), eager.prefill_batch(items))
        _assert_same_state(graphed, eager)
    keys = [(a[0].shape[:2], a[3].shape[0]) for a in calls]  # ((streams, rows), attention length)
    assert keys == [((4, 32), 64), ((1, 64), 64), ((2, 16), 64), ((2, 32), 128)]
    assert graphed.prefill_graphs.replays == 4 and graphed.prefill_graphs.eager_calls == 0


def test_warm_up_captures_every_bucket_and_leaves_the_slots_alone(model: MiniCPMTTS) -> None:
    """``warmup_prefill_graphs`` captures batch × width × attention-length buckets from padding-only inputs
    (no slot's K/V or length changes), then freezes the set: later prefills replay those graphs, a batch
    above the warmed size prefills eagerly, and the numbers stay the eager runner's."""
    eager = TalkerRunner(model, num_slots=4, use_cuda_graphs=False)
    graphed = TalkerRunner(model, num_slots=4, use_cuda_graphs=False)
    graphed.enable_prefill_graphs(capture=emulated_capture)
    items = [(0, _rows(model, 9, 11)), (1, _rows(model, 14, 12))]
    eager.prefill_batch(items)
    graphed.prefill_batch(items)
    before = [(k.clone(), v.clone()) for k, v in zip(graphed.cache.k, graphed.cache.v, strict=True)]
    lengths = {min(MIN_LENGTH_BUCKET << i, graphed.context) for i in range(16)}
    buckets = sum(b * r <= PREFILL_GRAPH_KEYS for b in (1, 2) for r in lengths) * len(PREFILL_WIDTHS)
    assert buckets == 2 * 7 * 3  # batches 1 and 2 at every length from 64 to 4096
    assert graphed.warmup_prefill_graphs(max_batch=2) == buckets
    graphs = graphed.prefill_graphs
    assert graphs is not None and graphs.frozen and graphed.prefill_graph_batch == 2
    assert graphed.cache.lengths == eager.cache.lengths == [9, 14, 0, 0]
    scratch = graphed.cache.scratch_index
    for (k0, v0), k, v in zip(before, graphed.cache.k, graphed.cache.v, strict=True):
        assert torch.equal(k0[:, :scratch], k[:, :scratch]) and torch.equal(v0[:, :scratch], v[:, :scratch])
    replays = graphs.replays
    for batch in (
        [(1, _rows(model, 6, 13)), (0, _rows(model, 25, 14))],
        [(2, _rows(model, 4, 15)), (3, _rows(model, 5, 16)), (0, _rows(model, 2, 17))],  # 3 > 2: eager
    ):
        torch.testing.assert_close(graphed.prefill_batch(batch), eager.prefill_batch(batch))
        _assert_same_state(graphed, eager)
    assert graphs.replays == replays + 1 and graphs.eager_calls == 0 and not graphs.eager_keys


def _engine_frames(model: MiniCPMTTS, graphs: bool) -> list[list[int]]:
    """Greedy frames of five streams of every form (whole, streaming, duplex units) on a 4-slot engine,
    with the prefill graphs warmed up and frozen, or eager."""
    engine = TalkerEngine(model, max_streams=4)
    if graphs:
        engine.runner.enable_prefill_graphs(capture=emulated_capture)
        assert engine.runner.warmup_prefill_graphs(engine.max_prefills_per_step) > 0
    greedy = engine.default_sampling(temperature=1.0, greedy=True)
    sinks = []
    for i, n in enumerate((5, 12, 8, 30, 70)):  # the 70-row condition is wider than every bucket
        sink = Sink()
        st = engine.open(engine.make_settings(sampling=greedy, fixed_frames=20 + 3 * i), sink)
        if i == 1:  # streaming: a chunk, then the last chunk
            engine.chunk(st, cond_input(model, n, 700 + i, last=False))
        engine.chunk(st, cond_input(model, n, 710 + i))
        engine.end(st)
        sinks.append(sink)
        if i == 2:
            engine.step()  # later streams join a batch that is decoding
    duplex = Sink()
    st = engine.open(engine.make_settings(sampling=greedy, duplex=True), duplex)
    for unit in range(3):
        engine.chunk(st, cond_input(model, 4 + unit, 720 + unit, last=False, turn_end=unit == 2))
    engine.end(st)
    engine.run_until_idle()
    if graphs:
        prefill = engine.runner.prefill_graphs
        assert prefill is not None and prefill.replays > 3 and prefill.eager_calls == 0
    assert all(len(sink.done) == 1 for sink in [*sinks, duplex])
    return [sink.frames for sink in [*sinks, duplex]]


def test_engine_frames_with_prefill_graphs_equal_eager(model: MiniCPMTTS) -> None:
    graphed = _engine_frames(model, graphs=True)
    assert graphed == _engine_frames(model, graphs=False)
    assert all(graphed)


def test_warm_up_lays_out_the_shared_arenas_once(model: MiniCPMTTS) -> None:
    """With the shared input/output arenas of the CUDA capture, the warm-up captures its largest bucket
    first, so each arena is allocated once for the whole set (a smaller buffer left behind would stay held
    by the graphs captured on it)."""
    shared = SharedBuffers()
    runner = TalkerRunner(model, num_slots=4, use_cuda_graphs=False)
    runner.enable_prefill_graphs(capture=lambda fn, args: emulated_capture(fn, args, shared))
    assert runner.warmup_prefill_graphs() > 0
    assert shared.inputs.allocations == shared.outputs.allocations == 1
