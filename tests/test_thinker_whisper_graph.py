"""The graphed streaming-Whisper pass (services/thinker/whisper_graph.py) on the CPU, with the capture
emulated on the host (tests/graph_emulation.py): its fixed shapes (rows padded to a bucket, attention over
every frame of a slot under a key mask) give the eager pass's rows and caches, padding rows touch only the
scratch slot, and a pass the graphs cannot serve runs eagerly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.thinker import whisper_graph
from services.thinker.backend import build_backend
from services.thinker.engine import EngineConfig
from services.thinker.model.audio import AudioStreamState, StreamPiece, WhisperChunkedEncoder
from services.thinker.model.config import AudioDims
from services.thinker.whisper_graph import WhisperStreamGraphs, warmup_whisper_stream_graphs
from tests.graph_emulation import emulated_capture

torch.set_num_threads(1)

DIMS = AudioDims(64, 2, 4, 256, 80, 1500, "gelu", 5, 1.0)
UNIT = 100  # mel frames of a 1 s unit


def _close(got: torch.Tensor, want: torch.Tensor, msg: str = "") -> None:
    """Equal to float rounding: more masked keys give the same weights, summed in another order."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=msg or None)


def _pair(
    capacity: int, max_batch: int
) -> tuple[WhisperChunkedEncoder, WhisperChunkedEncoder, WhisperStreamGraphs]:
    """An eager encoder and a copy with the same weights whose passes go through emulated graphs."""
    torch.manual_seed(0)
    eager = WhisperChunkedEncoder(DIMS).eval()
    eager.stream_pool.capacity = capacity
    graphed = WhisperChunkedEncoder(DIMS).eval()
    graphed.load_state_dict(eager.state_dict())
    graphed.stream_pool.capacity = capacity
    assert warmup_whisper_stream_graphs(graphed, max_batch, capture=emulated_capture) > 0
    graphs = graphed.stream_graphs
    assert isinstance(graphs, WhisperStreamGraphs)
    return eager, graphed, graphs


class _Streams:
    """The same sessions' audio fed to an encoder: session s's unit k is a fixed random mel piece."""

    def __init__(self, sessions: int) -> None:
        gen = torch.Generator().manual_seed(1)
        self.mels = [torch.randn(80, 40 * UNIT + 2, generator=gen) for _ in range(sessions)]
        self.units = [0] * sessions

    def pieces(self, who: list[int], states: list[AudioStreamState]) -> list[StreamPiece]:
        out = []
        for s in who:
            k = self.units[s]
            mel = self.mels[s]
            out.append(
                StreamPiece(
                    mel[:, k * UNIT : (k + 1) * UNIT], states[s], mel[:, (k + 1) * UNIT : (k + 1) * UNIT + 2]
                )
            )
        return out

    def advance(self, who: list[int]) -> None:
        for s in who:
            self.units[s] += 1


@torch.inference_mode()
def test_graphed_passes_equal_eager_passes_rows_and_caches() -> None:
    """Passes of 1, 3 (padded to 4) and 5 (padded to 8) sessions at different points of their streams, with
    sessions joining later, give the eager passes' rows; every session's cache holds the same keys and
    values; every pass replayed a graph."""
    eager, graphed, graphs = _pair(capacity=6, max_batch=8)
    feed = _Streams(5)
    eager_states = [AudioStreamState() for _ in range(5)]
    graphed_states = [AudioStreamState() for _ in range(5)]
    schedule = [[0], [0, 1, 2], [0, 1, 2], [2, 3], [0, 1, 2, 3, 4], [4, 1, 3, 0, 2]]
    warm = graphs.graphs.replays  # the warm-up's own replays
    for who in schedule:
        want = eager.forward_chunks(feed.pieces(who, eager_states))
        got = graphed.forward_chunks(feed.pieces(who, graphed_states))
        feed.advance(who)
        _close(got, want, f"pass over sessions {who}")
    for s in range(5):
        assert graphed_states[s].frames == eager_states[s].frames
        for (kg, vg), (ke, ve) in zip(graphed_states[s].kv, eager_states[s].kv, strict=True):
            _close(kg, ke)
            _close(vg, ve)
    assert graphs.graphs.replays - warm == len(schedule) and graphs.graphs.eager_calls == 0
    assert graphs.graphs.captured == 4  # buckets 1, 2, 4, 8


@torch.inference_mode()
def test_padding_rows_write_only_the_scratch_slot_which_no_session_gets() -> None:
    _, graphed, graphs = _pair(capacity=4, max_batch=4)
    pool = graphed.stream_pool
    assert pool.tensor is not None and pool.tensor.shape[0] == 5 and pool.in_use == 0
    feed = _Streams(1)
    state = AudioStreamState()
    graphed.forward_chunks(feed.pieces([0], [state]))  # bucket 1: no padding
    feed.advance([0])
    before = pool.tensor.clone()
    graphed.forward_chunks(feed.pieces([0], [state]))
    untouched = [s for s in range(pool.tensor.shape[0]) if s not in (state.slot, graphs.scratch)]
    for s in untouched:
        assert torch.equal(pool.tensor[s], before[s]) and not pool.tensor[s].any()
    others = [AudioStreamState() for _ in range(3)]
    graphed.forward_chunks(
        _Streams(3).pieces([0, 1, 2], others)
    )  # 3 rows in the 4-row graph: one padding row
    assert graphs.scratch not in {state.slot, *(o.slot for o in others)}
    assert pool.in_use == 4


@torch.inference_mode()
def test_a_pass_the_graphs_cannot_serve_runs_eagerly_with_the_same_rows() -> None:
    """More rows than the largest bucket, a piece of another length, and a pool that grew (the graphs
    read the old tensor) run the eager path, which gives the same rows."""
    eager, graphed, graphs = _pair(capacity=3, max_batch=2)
    feed = _Streams(4)
    warm = graphs.graphs.replays
    es = [AudioStreamState() for _ in range(4)]
    gs = [AudioStreamState() for _ in range(4)]
    for who in ([0, 1, 2], [0, 1]):  # 3 rows > bucket 2; then 2 rows, served by a graph
        _close(graphed.forward_chunks(feed.pieces(who, gs)), eager.forward_chunks(feed.pieces(who, es)))
        feed.advance(who)
    assert graphs.graphs.replays - warm == 1
    long_piece = torch.randn(80, 2 * UNIT, generator=torch.Generator().manual_seed(3))
    ge = graphed.forward_chunks([StreamPiece(long_piece, gs[0])])
    ee = eager.forward_chunks([StreamPiece(long_piece, es[0])])
    _close(ge, ee)
    assert graphs.graphs.replays - warm == 1  # 100 encoder frames: not a one-unit graph
    pool = graphed.stream_pool
    assert pool.tensor is not None
    captured_on = pool.tensor
    who = [3]  # a 4th session: the 4-slot pool (3 + scratch) is full, so it doubles
    got = graphed.forward_chunks(feed.pieces(who, gs))
    want = eager.forward_chunks(feed.pieces(who, es))
    _close(got, want)
    assert pool.tensor is not captured_on and graphs.graphs.replays - warm == 1
    assert gs[3].slot is not None
    assert graphs.run(torch.zeros(1, 50, DIMS.d_model), [gs[3].slot], [0]) is None


def test_warmup_through_the_thinker_model_and_its_memory_reserve(tiny_ckpt: Path) -> None:
    """The start-up path on the tiny checkpoint: the pooled cache gets the scratch slot on top of the
    sessions' slots, every bucket up to the thinker's pass limit is captured, and on a GPU the KV reserve
    counts the scratch slot and the largest graph's gather."""
    cfg = EngineConfig(kv_budget_bytes=None, max_num_seqs=2, max_step_tokens=128)
    backend = build_backend(str(tiny_ckpt), "cpu", "float32", cfg)
    try:
        model = backend.model
        pool = model.apm.stream_pool
        assert pool.capacity == 4  # max_num_seqs + 2
        assert warmup_whisper_stream_graphs(model.apm, 4) == 0  # on the CPU without a capture hook: nothing
        assert model.apm.stream_graphs is None and pool.tensor is None
        assert warmup_whisper_stream_graphs(model.apm, 4, capture=emulated_capture) == 3  # buckets 1, 2, 4
        assert pool.capacity == 5 and pool.tensor is not None and pool.tensor.shape[0] == 5
        assert model.apm.stream_graphs is not None
        rows = 4 * DIMS.max_source_positions * model.dims.audio.d_model * 4  # 4 rows, fp32
        cuda = torch.device("cuda")
        assert whisper_graph.reserve_bytes(model, 4, cuda) == model.audio_stream_bytes() + 4 * rows
        assert whisper_graph.reserve_bytes(model, 3, cuda) == whisper_graph.reserve_bytes(model, 4, cuda)
        assert whisper_graph.reserve_bytes(model, 4, torch.device("cpu")) == 0  # no graphs there
    finally:
        backend.executor.shutdown(wait=False)


@pytest.mark.parametrize(("limit", "buckets"), [(1, [1]), (4, [1, 2, 4]), (18, [1, 2, 4, 8, 16, 32])])
def test_batch_buckets(limit: int, buckets: list[int]) -> None:
    assert whisper_graph.batch_buckets(limit) == buckets
