"""Host-side stand-ins for CUDA-graph captures, for CPU tests: the thinker's (``ModelRunner.graph_capture``)
and the shape-keyed graph sets of the talker and code2wav (:func:`emulated_capture`).

The row graph hands its body (which reads the static input buffers) to the capture hook; here "replay"
reruns that body and copies its outputs into the tensors the first run returned, as a real graph replay
writes into the captured outputs. So graph-only engine paths (packed-row steps, the overlapped decode,
the folded-norm loop and its skinny O projection) run on the CPU with the same buffer discipline.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.common.cuda_graphs import (
    Capture,
    Captured,
    GraphFn,
    SharedBuffers,
    as_tuple,
    static_inputs,
)


def emulated(
    runner: object, body: Callable[[], tuple[torch.Tensor, torch.Tensor]]
) -> tuple[Callable[[], None], tuple[torch.Tensor, torch.Tensor]]:
    """The capture hook: ``(replay, (hidden, logits))`` with replay rerunning ``body`` into those outputs."""
    out = body()

    def replay() -> None:
        hidden, logits = body()
        out[0].copy_(hidden)
        out[1].copy_(logits)

    return replay, out


class ReplayEmulation:
    """Host-side stand-in for a captured :class:`services.common.cuda_graphs.ShapeKeyedGraphs` graph.

    Replay recomputes from the static inputs into the same static output tensors, so callers see exactly
    the buffer reuse a real graph imposes; a function marked ``fills_outputs`` writes into them itself.
    """

    def __init__(self, fn: GraphFn, inputs: list[torch.Tensor | None], outputs: tuple[torch.Tensor, ...]):
        self.fn, self.inputs, self.outputs = fn, inputs, outputs

    def replay(self) -> None:
        if getattr(self.fn, "fills_outputs", False):
            self.fn(*self.inputs, out=self.outputs)
            return
        for out, new in zip(self.outputs, as_tuple(self.fn(*self.inputs)), strict=True):
            out.copy_(new)


def emulated_capture(
    fn: GraphFn, args: tuple[torch.Tensor | None, ...], shared: SharedBuffers | None = None
) -> Captured:
    """The capture hook of :class:`ShapeKeyedGraphs` on the CPU: static inputs (views of ``shared``'s input
    arena, as on CUDA, or private clones) and outputs (views of its output arena, or private clones)."""
    inputs = static_inputs(args, None if shared is None else shared.inputs)
    probe = as_tuple(fn(*inputs))
    outputs = tuple(o.clone() for o in probe) if shared is None else shared.outputs.views(probe)
    return Captured(ReplayEmulation(fn, inputs, outputs), inputs, outputs)


def recording_capture(calls: list, capture: Capture = emulated_capture) -> Capture:
    """Wraps a capture so the test sees the arguments of every key it was asked to capture."""

    def capture_and_record(fn: GraphFn, args: tuple[torch.Tensor | None, ...]) -> Captured:
        calls.append(args)
        return capture(fn, args)

    return capture_and_record
