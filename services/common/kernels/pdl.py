"""Programmatic dependent launch (PDL) for the decode step's Triton kernels.

Why: a graphed fp8 decode step of the full-size thinker is ~216 small kernels back to back (six a
layer); between two of them the GPU drains the first grid, then launches and rasterises the second.
With PDL (Hopper and later) a kernel launched with the programmatic-serialisation attribute may start
its programs as soon as every program of the kernel before it has signalled
(``griddepcontrol.launch_dependents``), so its launch overlaps the previous kernel's work instead of
following it. CUDA graphs keep the attribute as a programmatic edge.

The contract every kernel that takes ``PDL`` keeps: it calls :func:`pdl_enter` before its first memory
access. That waits for the previous grid to finish and its writes to be visible
(``griddepcontrol.wait``, a no-op when the launch had no attribute), then lets the next kernel launch.
Waiting first means a chain never runs ahead more than one kernel: a kernel's programs occupy SMs early
only while its predecessor runs, never while it is itself waiting. Kernels that do not take part (torch's,
cuBLAS's) launch as usual, and a PDL kernel after one of them simply starts when it ends.

One owner: :func:`set_pdl` (on by default; a benchmark's other arm turns it off, then recaptures its
graphs), read at launch time by :func:`pdl_launch`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_requested: bool | None = None
_capable: dict[int, bool] = {}


def set_pdl(requested: bool | None) -> None:
    """On (None or True: wherever the device supports it) or off (False) for later launches. Graphs
    captured before keep the launches they recorded."""
    global _requested
    _requested = requested


def pdl_launch(device: torch.device) -> bool:
    """Whether a kernel launched now on ``device`` goes out with PDL: a CUDA device of compute
    capability 9.0 or later (Hopper), unless :func:`set_pdl` turned it off. Never on CPU (Triton's
    interpreter runs no inline PTX)."""
    if _requested is False or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    ok = _capable.get(index)
    if ok is None:
        ok = _capable[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return ok


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
def pdl_enter(PDL: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    """At the top of a kernel launched with ``launch_pdl=PDL``: wait for the previous grid, then let the
    next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
