"""A host-side stand-in for the thinker's CUDA-graph capture (``ModelRunner.graph_capture``), for CPU tests.

The row graph hands its body (which reads the static input buffers) to the capture hook; here "replay"
reruns that body and copies its outputs into the tensors the first run returned, as a real graph replay
writes into the captured outputs. So graph-only engine paths (packed-row steps, the overlapped decode,
the folded-norm loop and its skinny O projection) run on the CPU with the same buffer discipline.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


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
