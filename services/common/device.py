"""Host-to-device copies of a stage's small per-call inputs (ids, positions, masks, mel windows, rows)."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; a CPU tensor goes to a GPU through pinned memory without a stream sync (a
    plain copy from pageable memory waits for every kernel queued before it, the engine's included)."""
    if t.device == device or device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
