"""CUDA graphs for the fixed window shapes of the Code2Wav stage (GPU only; CPU stays eager).

What is captured, per distinct input-shape key:

* with the fused DiT (``FlowStepper.fused``): a window's whole 10-step guided solve
  (:meth:`FusedDiTSolver.solve`, no host work between steps), which writes its per-step caches straight
  into the shared output arena (``fills_outputs``), and the conformer encoder chunk (embedding,
  conformer, projection; one set for non-final windows, one for last windows);
* with the package DiT: one DiT estimator evaluation with caches (:func:`dit_blocks_chunk`): the 10-step
  Euler loop stays in Python and replays the graph once per step; the time embedding is computed outside
  (the package builds its frequency table on the host);
* the HiFT f0 predictor and the HiFT decoder up to ``conv_post`` (``torch.istft`` checks its window on the
  host, so the inverse STFT and the NSF source, which draws per-stream random numbers, stay eager).

When: at startup, before the server reports serving, :meth:`Code2WavRunner.warm_up_shapes` drives
throwaway batches of every size 1..``max_batch`` through the usual window shapes (a first window of 10
or of 25 codes, then steady 25-code windows: estimator caches of 300 frames after the 6 s prompt grow by
20 or 50 frames per window until trimming holds them at 400), 12 keys per batch size (6 DiT, 3 f0, 3
decoder; the fused path adds its encoder graphs and the last windows: the empty one at every batch size,
the talker's remainders of 1..24 codes at the power-of-two batch sizes 1, 2, 4, ..., and at batch 1 the
same last windows from the caches of a short reply, before they are steady), capturing each key on first
use, and then *freezes* every set. A frozen set never captures: a key it has not seen (an uncovered last
window, an unusual first window) runs eager and is logged once. A batch of last windows of a size without
a graph runs as the largest sizes its key was captured at (7 remainders as 4 + 2 + 1, short replies' last
windows one at a time; :meth:`Code2WavRunner.sub_batches`), each replaying its graphs.
Capturing while serving is what failed on the H200 with three stages time-slicing the GPU (a cuDNN error
inside the capture, then an illegal address that killed every later window), so after the warm-up it
does not happen. A set that is never frozen (benchmarks that skip the warm-up) captures lazily, up to
``max_graphs`` keys per part.

Memory: all sets share one graph pool and one pair of input/output arenas
(:mod:`services.common.cuda_graphs`). A DiT graph reads and returns full attention caches; kept per graph
these would cost tens of GiB over 16 batch sizes, shared the set costs about what its largest graph
costs. The callers keep the pool's contract (a replay's outputs are valid until the next replay of any
graph): ``FlowStepper._solve`` copies each step's caches; the graphed encoder clones its outputs before
the solve replays; ``Code2WavRunner.run_batch`` splits the flow caches and copies the mel before the
vocoder replays; the vocoder feeds the f0 into the eager NSF source before the decoder replays.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from services.code2wav.model.flow_step import dit_blocks_chunk
from services.code2wav.model.vocoder import hift_pre_istft
from services.common.cuda_graphs import (
    Capture,
    ShapeKeyedGraphs,
    SharedBuffers,
    as_tuple,
    capture_cuda_graph,
)


def enable_cuda_graphs(
    runner: Any, max_graphs: int = 256, capture: Capture | None = None
) -> dict[str, ShapeKeyedGraphs]:
    """Route the runner's DiT estimator and HiFT parts through shape-keyed CUDA graphs (CUDA only).

    The three sets share one graph memory pool and one pair of input/output arenas (module docstring).
    They start unfrozen; :meth:`Code2WavRunner.warm_up_shapes` captures the serving shapes and freezes
    them.
    ``capture`` replaces the real capture (tests emulate replay semantics on CPU with it)."""
    flow = runner.flow
    vocoder = runner.vocoder
    if capture is None:
        if runner.device.type != "cuda":
            return {}
        capture = functools.partial(
            capture_cuda_graph, pool=torch.cuda.graph_pool_handle(), shared=SharedBuffers()
        )
    hift = vocoder.hift
    f0 = ShapeKeyedGraphs("hift_f0", lambda mel: (hift.f0_predictor(mel),), max_graphs, capture)
    decode = ShapeKeyedGraphs(
        "hift_decode", lambda mel, source: (hift_pre_istft(hift, mel, source),), max_graphs, capture
    )
    vocoder.f0_fn = lambda mel: f0(mel)[0]
    vocoder.decode_fn = lambda mel, source: decode(mel, source)[0]
    if flow.fused is not None:
        sets = _graph_fused_flow(flow, max_graphs, capture)
    else:
        sets = {"dit": _graph_package_estimator(flow, max_graphs, capture)}
    sets.update({"hift_f0": f0, "hift_decode": decode})
    runner.graph_sets = sets
    runner.cuda_graphs = True
    return sets


class _FillsOutputs:
    """A graph function that writes its results into given tensors (``out=``): captured with the output
    arena's views as ``out``, so its large results (a window's per-step DiT caches) are written once,
    straight into the arena, instead of into the graph pool and then copied."""

    fills_outputs = True

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]]) -> None:
        self.fn = fn

    def __call__(self, *args: torch.Tensor | None, out: Any = None) -> tuple[torch.Tensor, ...]:
        return as_tuple(self.fn(*args, out=out))


def _graph_fused_flow(flow: Any, max_graphs: int, capture: Capture) -> dict[str, ShapeKeyedGraphs]:
    """The fused flow path: the whole 10-step solve is one graph per shape key, and the conformer
    encoder chunk (embedding, conformer, projection) another, one set for non-final windows and one for
    last windows (the encoder pads the lookahead on a last window)."""
    solve = ShapeKeyedGraphs("flow_solve", _FillsOutputs(flow.fused.solve), max_graphs, capture)
    encoders = {
        name: ShapeKeyedGraphs(
            name, functools.partial(flow._encode_eager, last=name == "encoder_last"), max_graphs, capture
        )
        for name in ("encoder", "encoder_last")
    }

    def graphed_solve(z, mu, spks, cond, cnn, att):  # noqa: ANN001, ANN202
        if att is None:  # prompt setup: once per voice and seed, not worth a graph
            return flow.eager_solver(z, mu, spks, cond, cnn, att)
        return solve(z, mu, spks, cond, cnn, att)

    def graphed_encoder(graphs: ShapeKeyedGraphs) -> Callable[..., tuple[torch.Tensor, ...]]:
        # The solve replays next and overwrites the shared output arena: keep private copies (small).
        return lambda tokens, cnn, att: tuple(t.clone() for t in graphs(tokens, cnn, att))

    flow.solver = graphed_solve
    flow.encode = graphed_encoder(encoders["encoder"])
    flow.encode_last = graphed_encoder(encoders["encoder_last"])
    return {"flow_solve": solve, **encoders}


def _graph_package_estimator(flow: Any, max_graphs: int, capture: Capture) -> ShapeKeyedGraphs:
    """The package DiT path: one graph per Euler step (the loop and the time embedding stay eager)."""
    dit = flow.dit
    estimator = ShapeKeyedGraphs(
        "dit",
        lambda x, mu, temb, spks, cond, cnn, att: dit_blocks_chunk(dit, x, mu, temb, spks, cond, cnn, att),
        max_graphs,
        capture,
    )
    eager_estimator = flow.estimator

    def graphed_estimator(x, mu, temb, spks, cond, cnn, att):  # noqa: ANN001, ANN202
        if att is None:  # prompt setup: runs once per voice and seed, not worth a graph
            return eager_estimator(x, mu, temb, spks, cond, cnn, att)
        return estimator(x, mu, temb, spks, cond, cnn, att)

    flow.estimator = graphed_estimator
    return estimator
