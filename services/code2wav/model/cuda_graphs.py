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
the talker's remainders of 1..24 codes at the power-of-two batch sizes 1, 2, 4, ...), capturing each key
on first use, and then *freezes* every set. A frozen set never captures: a key it has not seen (an
uncovered last window, an unusual first window) runs eager and is logged once. A batch of remainder
last windows of another size runs as its power-of-two parts (7 as 4 + 2 + 1,
:meth:`Code2WavRunner.sub_batches`), each replaying its graphs.
Capturing while serving is what failed on the H200 with three stages time-slicing the GPU (a cuDNN error
inside the capture, then an illegal address that killed every later window), so after the warm-up it
does not happen. A set that is never frozen (benchmarks that skip the warm-up) captures lazily, up to
``max_graphs`` keys per part.

Memory: all graphs share one private pool (``torch.cuda.graph_pool_handle()``), so their intermediates
overlap instead of adding up, and their static inputs and outputs are views into one shared input and
one shared output :class:`SharedArena` (each graph ends with a copy into the output arena), so those do
not add up either: a DiT graph reads and returns full attention caches, and kept per graph these would
cost tens of GiB over 16 batch sizes, while shared the set costs about what its largest graph costs.
This is safe because one thread runs every replay in sequence on one stream, inputs are copied in right
before each replay, and callers keep the contract they already kept: a replay's outputs are valid only
until the next replay of *any* graph, so callers consume or copy them first (``FlowStepper._solve``
copies each step's caches; the graphed encoder clones its outputs before the solve replays;
``Code2WavRunner.run_batch`` splits the flow caches and copies the mel before the vocoder replays; the vocoder feeds the f0 into the eager NSF source before the decoder
replays). A key whose capture fails falls back to eager for good.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from services.code2wav.model.flow_step import dit_blocks_chunk
from services.code2wav.model.vocoder import hift_pre_istft

log = logging.getLogger(__name__)

Key = tuple[tuple[tuple[int, ...], torch.dtype] | None, ...]
GraphFn = Callable[..., tuple[torch.Tensor, ...]]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph  # anything with replay(); tests substitute a host-side emulation
    inputs: list[torch.Tensor | None]
    outputs: tuple[torch.Tensor, ...]


Capture = Callable[[GraphFn, tuple[torch.Tensor | None, ...]], _Captured]


def _as_tuple(out: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


class SharedArena:
    """One flat device buffer that every graph of a pool lays its static tensors out in, from offset 0.

    Graph inputs and outputs must live at fixed addresses. Kept per graph they would add up over the
    warm-up's 1..``max_batch`` batch sizes (a DiT graph reads and returns full attention caches: tens of
    GiB at batch 16). They need not be kept apart: a graph's inputs are copied in right before its replay
    and its outputs are consumed before the next replay (module docstring), so every graph may use the
    same bytes. Inputs and outputs get one arena each, since a graph reads the one while writing the other.
    The buffer grows by ``growth`` when a capture needs more; the old buffer stays alive through the views
    of the graphs captured on it, which is why the warm-up captures the largest batches first.
    """

    ALIGN = 512  # bytes; keeps every view aligned for any dtype and for vectorised copies

    def __init__(self, growth: float = 1.5) -> None:
        self.growth = growth
        self.buffer: torch.Tensor | None = None
        self.allocations = 0

    @staticmethod
    def _layout(t: torch.Tensor) -> tuple[tuple[int, ...], int]:
        """Strides to give the view (``t``'s own when dense, as ``clone`` keeps them) and its element span."""
        if t.numel() == 0:
            return tuple(t.stride()), 0
        span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
        if span == t.numel() and all(stride >= 0 for stride in t.stride()):
            return tuple(t.stride()), span
        return torch.empty(t.shape, device="meta").stride(), t.numel()  # overlapping or gapped: contiguous

    def views(self, like: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Tensors shaped, strided and typed like ``like``, packed from the start of the shared buffer."""
        layouts, offsets, total = [], [], 0
        for t in like:
            stride, span = self._layout(t)
            layouts.append((stride, span))
            offsets.append(total)
            total += -(-span * t.element_size() // self.ALIGN) * self.ALIGN
        device = like[0].device if like else torch.device("cpu")
        buf = self.buffer
        if buf is None or buf.numel() < total or buf.device != device:
            buf = self.buffer = torch.empty(
                max(int(total * self.growth), total, 1), dtype=torch.uint8, device=device
            )
            self.allocations += 1
        out = []
        for t, offset, (stride, span) in zip(like, offsets, layouts, strict=True):
            flat = buf[offset : offset + span * t.element_size()].view(t.dtype)
            out.append(flat.as_strided(t.shape, stride))
        return tuple(out)

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()


@dataclass
class SharedBuffers:
    """The two arenas of one graph pool: static inputs and outputs."""

    inputs: SharedArena = field(default_factory=SharedArena)
    outputs: SharedArena = field(default_factory=SharedArena)


def static_inputs(
    args: tuple[torch.Tensor | None, ...], arena: SharedArena | None = None
) -> list[torch.Tensor | None]:
    """Static copies of ``args`` for a capture: views of ``arena`` (shared by every graph) or clones."""
    if arena is None:
        return [None if a is None else a.clone() for a in args]
    views = iter(arena.views([a for a in args if a is not None]))
    inputs: list[torch.Tensor | None] = []
    for arg in args:
        static = None if arg is None else next(views).copy_(arg)
        inputs.append(static)
    return inputs


def capture_cuda_graph(
    fn: GraphFn,
    args: tuple[torch.Tensor | None, ...],
    pool: Any = None,
    shared: SharedBuffers | None = None,
) -> _Captured:
    """Warm ``fn`` up on a side stream, then capture it on static copies of ``args``.

    ``pool`` is the shared graph memory pool. With ``shared``, the static inputs are views of the shared
    input arena and the graph's last kernels copy its outputs into the shared output arena (both allocated
    here, outside the capture), whose views become the outputs; without, both are private to the graph."""
    inputs = static_inputs(args, None if shared is None else shared.inputs)
    fills = shared is not None and getattr(fn, "fills_outputs", False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # Warm up kernels, cuBLAS/cuFFT plans and the allocator off the graph (a whole CFM solve once:
        # its kernels are the ones every earlier window already ran).
        for _ in range(1 if fills else 2):
            probe = _as_tuple(fn(*inputs))
    torch.cuda.current_stream().wait_stream(side)
    targets = None if shared is None else shared.outputs.views(probe)
    del probe
    graph = torch.cuda.CUDAGraph()
    # thread_local: a CUDA call from another thread of the server (a freed tensor's stream event, the
    # gRPC side) must not invalidate this capture. Seen on the H200 as a cuDNN "unable to find an engine"
    # during capture, after which the process hit an illegal address.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        if fills:  # the function writes its results into the output arena itself: no copy, no duplicate
            fn(*inputs, out=targets)
            outputs = targets
        else:
            outputs = _as_tuple(fn(*inputs))
        if targets is not None and not fills:
            assert outputs is not None
            for target, out in zip(targets, outputs, strict=True):
                target.copy_(out)
            outputs = targets
    assert outputs is not None
    return _Captured(graph, inputs, outputs)


class ShapeKeyedGraphs:
    """Replays one CUDA graph per input-shape key of ``fn``; eager for keys it cannot (or may not) hold.

    ``frozen`` (set after the startup warm-up) forbids new captures: an unknown key then runs eager, so
    no capture ever happens under live traffic. ``replays`` and ``eager_calls`` count calls either way."""

    def __init__(
        self,
        name: str,
        fn: GraphFn,
        max_graphs: int = 256,
        capture: Capture = capture_cuda_graph,
    ) -> None:
        self.name = name
        self.fn = fn
        self.max_graphs = max_graphs
        self.capture = capture
        self.graphs: dict[Key, _Captured | None] = {}  # None: capture failed or over max_graphs
        self.frozen = False
        self.eager_keys: set[Key] = set()  # keys first met while frozen (each logged once)
        self.replays = 0
        self.eager_calls = 0

    @staticmethod
    def key(args: tuple[torch.Tensor | None, ...]) -> Key:
        return tuple(None if a is None else (tuple(a.shape), a.dtype) for a in args)

    @property
    def captured(self) -> int:
        """Keys that hold a graph (failed captures and keys over ``max_graphs`` excluded)."""
        return sum(entry is not None for entry in self.graphs.values())

    def _eager(self, args: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor, ...]:
        self.eager_calls += 1
        return _as_tuple(self.fn(*args))

    def __call__(self, *args: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        key = self.key(args)
        if key not in self.graphs:
            if self.frozen:
                if key not in self.eager_keys:
                    self.eager_keys.add(key)
                    log.info("%s: no graph for %s (set frozen after warm-up); running eager", self.name, key)
                return self._eager(args)
            entry = self._capture(key, args)
        else:
            entry = self.graphs[key]
        if entry is None:
            return self._eager(args)
        for static, arg in zip(entry.inputs, args, strict=True):
            if static is not None and arg is not None:
                static.copy_(arg)
        entry.graph.replay()
        self.replays += 1
        return entry.outputs

    def _capture(self, key: Key, args: tuple[torch.Tensor | None, ...]) -> _Captured | None:
        entry: _Captured | None = None
        if len(self.graphs) < self.max_graphs:
            try:
                entry = self.capture(self.fn, args)
                log.debug("captured %s graph #%d for %s", self.name, self.captured + 1, key)
            except Exception as exc:  # noqa: BLE001 - a shape we cannot capture simply runs eager
                log.warning("%s: CUDA graph capture failed for %s (%s); running eager", self.name, key, exc)
                if any(a is not None and a.is_cuda for a in args):
                    # A failed capture can leave the device in an error state; surface it here, at the
                    # capture, rather than as an unrelated error in the next kernel.
                    torch.cuda.synchronize()
        self.graphs[key] = entry
        return entry


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
        return _as_tuple(self.fn(*args, out=out))


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
