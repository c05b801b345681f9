"""The shape-keyed CUDA-graph set shared by the talker and code2wav (services/common/cuda_graphs.py), on the
CPU with a host-side replay: keys, freezing, and the shared input/output arenas."""

from __future__ import annotations

import torch

from services.common.cuda_graphs import ShapeKeyedGraphs, SharedArena, static_inputs
from tests.graph_emulation import recording_capture


def test_frozen_graph_set_never_captures_and_runs_eager(caplog) -> None:  # noqa: ANN001
    """Unfrozen, a new key is captured and replayed; frozen, a new key is never captured: it runs the
    plain function (identical numbers), counts as eager and is logged once, while captured keys replay."""

    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(x) @ w, x.sum(0)

    gen = torch.Generator().manual_seed(0)
    small = (torch.randn(2, 3, generator=gen), torch.randn(3, 4, generator=gen))
    large = (torch.randn(5, 3, generator=gen), torch.randn(3, 4, generator=gen))
    calls: list = []
    graphs = ShapeKeyedGraphs("t", fn, capture=recording_capture(calls))
    out = graphs(*small)
    assert len(calls) == 1 and graphs.captured == 1 and (graphs.replays, graphs.eager_calls) == (1, 0)
    assert all(torch.equal(o, e) for o, e in zip(out, fn(*small), strict=True))

    graphs.frozen = True
    with caplog.at_level("INFO", logger="services.common.cuda_graphs"):
        for _ in range(2):
            out = graphs(*large)
            assert all(torch.equal(o, e) for o, e in zip(out, fn(*large), strict=True))
    assert len(calls) == 1 and graphs.captured == 1 and graphs.eager_calls == 2
    assert graphs.eager_keys == {ShapeKeyedGraphs.key(large)}
    assert sum("running eager" in r.getMessage() for r in caplog.records) == 1
    graphs(*small)  # a key captured before the freeze still replays
    assert graphs.replays == 2 and len(calls) == 1


def test_shared_arena_packs_views_and_grows() -> None:
    """Views are aligned, typed, shaped and strided like the tensors they stand for, start at the buffer's
    first byte, and a larger request allocates a bigger buffer while older views keep theirs."""

    arena = SharedArena(growth=1.5)
    a, b = arena.views([torch.zeros(3, 5), torch.zeros(7, dtype=torch.int64)])
    assert (a.shape, a.dtype, b.shape, b.dtype) == ((3, 5), torch.float32, (7,), torch.int64)
    assert a.data_ptr() == arena.buffer.data_ptr() and b.data_ptr() - a.data_ptr() == SharedArena.ALIGN
    (t,) = arena.views([torch.zeros(5, 3).t()])  # a dense transposed tensor keeps its strides, as clone does
    assert t.shape == (3, 5) and t.stride() == (1, 3)
    (e,) = arena.views([torch.zeros(3, 1).expand(3, 4)])  # overlapping: laid out contiguously instead
    assert e.stride() == (4, 1)
    first = arena.buffer
    (c,) = arena.views([torch.zeros(100)])  # fits in 1.5 x 1024 bytes: same buffer
    assert arena.buffer is first and c.data_ptr() == a.data_ptr() and arena.allocations == 1
    (d,) = arena.views([torch.zeros(1000)])
    assert arena.allocations == 2 and d.data_ptr() == arena.buffer.data_ptr() != first.data_ptr()
    assert arena.nbytes == int(4096 * 1.5)
    x = torch.arange(6.0).reshape(2, 3)
    static = static_inputs((x, None, x + 1), arena)
    assert static[1] is None and torch.equal(static[0], x) and torch.equal(static[2], x + 1)
    assert static[0].data_ptr() == arena.buffer.data_ptr()
