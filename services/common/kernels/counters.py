"""Arrival counters of the split-K merges (paged attention, the skinny and fp8 GEMMs), one buffer per device.

A split kernel's last program to finish a tile merges the partial results; it learns it is last from an
int32 counter that every split of the tile increments. The buffer is persistent, because a CUDA graph
records its pointer, and the kernel leaves every counter it used at zero, so a step pays no memset. It
grows only outside a capture (the eager warm-up passes before a capture run the same shapes); a buffer
that is replaced stays alive, since graphs captured earlier still point at it.
"""

from __future__ import annotations

import torch


class ArrivalCounters:
    """Zeroed int32 counters per device for one kind of split kernel (``what`` names it in errors)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []

    def __getitem__(self, device: torch.device) -> torch.Tensor:
        return self._buffers[device]

    def get(self, device: torch.device, needed: int) -> torch.Tensor:
        """At least ``needed`` zeroed counters on ``device`` (raises inside a capture if it must grow)."""
        buf = self._buffers.get(device)
        if buf is None or buf.numel() < needed:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{self.what} must be sized before a CUDA-graph capture")
            if buf is not None:
                self._retired.append(buf)
            buf = torch.zeros(max(needed, 4096), dtype=torch.int32, device=device)
            self._buffers[device] = buf
        return buf


def split_scratch(
    counters: ArrivalCounters, out: torch.Tensor, splits: int, groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split-K scratch of an attention launch that writes ``out [T, heads, D]``: per split the fp32
    partial outputs, running maxima and sums, and ``groups`` arrival counters (one per merged group).

    With one split nothing is merged, and ``out`` stands in for all four (the kernel never touches them).
    """
    if splits == 1:
        return out, out, out, out
    t, h, d = out.shape
    po = torch.empty((splits, t, h, d), dtype=torch.float32, device=out.device)
    pm = torch.empty((splits, t, h), dtype=torch.float32, device=out.device)
    pl = torch.empty((splits, t, h), dtype=torch.float32, device=out.device)
    return po, pm, pl, counters.get(out.device, groups)
