"""Shape-keyed CUDA graphs that any stage can route a fixed-shape function through (GPU; tests emulate).

:class:`ShapeKeyedGraphs` wraps a function of tensors: the first call with a new input-shape key captures
the function into a CUDA graph on static copies of its inputs (:func:`capture_cuda_graph`: two warm-up runs
on a side stream, then the capture), later calls with that key copy their inputs in and replay. After the
start-up warm-up a stage *freezes* the set: a key it has not seen then runs eagerly (logged once) instead
of being captured under live traffic, where a capture beside other CUDA work of the process has failed
(a cuDNN error inside the capture on the H200, then an illegal address). A key whose capture fails runs
eagerly for good. The capture hook is a parameter, so CPU tests substitute a host-side replay.

Memory: graphs captured into one private pool (``torch.cuda.graph_pool_handle()``) share their
intermediates; with :class:`SharedBuffers` their static inputs and outputs are views of one input and one
output :class:`SharedArena` as well, so a set costs about what its largest graph costs. The contract that
makes this safe is the caller's: one thread replays the set's graphs in sequence on one stream, and a
replay's outputs are valid only until the next replay of any graph of the pool, so callers consume or
copy them first.

Users: the Code2Wav stage's DiT, conformer and HiFT parts, and the Talker's batched prefill (each stage
wires its own functions through a set; this module knows neither).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)

Key = tuple[tuple[tuple[int, ...], torch.dtype] | None, ...]
GraphFn = Callable[..., tuple[torch.Tensor, ...]]


class Replayable(Protocol):
    """A captured graph: ``torch.cuda.CUDAGraph``, or the host-side emulation CPU tests substitute."""

    def replay(self) -> None: ...


@dataclass
class Captured:
    graph: Replayable
    inputs: list[torch.Tensor | None]
    outputs: tuple[torch.Tensor, ...]


Capture = Callable[[GraphFn, tuple[torch.Tensor | None, ...]], Captured]


def as_tuple(out: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
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
) -> Captured:
    """Warm ``fn`` up on a side stream, then capture it on static copies of ``args``.

    ``pool`` is the shared graph memory pool. With ``shared``, the static inputs are views of the shared
    input arena and the graph's last kernels copy its outputs into the shared output arena (both allocated
    here, outside the capture), whose views become the outputs; without, both are private to the graph."""
    inputs = static_inputs(args, None if shared is None else shared.inputs)
    fills = shared is not None and getattr(fn, "fills_outputs", False)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # Warm up kernels, cuBLAS/cuFFT plans and the allocator off the graph (a whole CFM solve once:
        # its kernels are the ones every earlier window already ran).
        for _ in range(1 if fills else 2):
            probe = as_tuple(fn(*inputs))
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
            outputs = as_tuple(fn(*inputs))
        if targets is not None and not fills:
            assert outputs is not None
            for target, out in zip(targets, outputs, strict=True):
                target.copy_(out)
            outputs = targets
    assert outputs is not None
    return Captured(graph, inputs, outputs)


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
        self.graphs: dict[Key, Captured | None] = {}  # None: capture failed or over max_graphs
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
        return as_tuple(self.fn(*args))

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

    def _capture(self, key: Key, args: tuple[torch.Tensor | None, ...]) -> Captured | None:
        entry: Captured | None = None
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
