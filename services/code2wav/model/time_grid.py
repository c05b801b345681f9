"""The CFM solver's time grid, shared by the package-path solve (``flow_step``) and the fused one
(``fused_dit``), which must step through exactly the same times."""

from __future__ import annotations

import math

import torch


def cosine_time_span(n_timesteps: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Euler time grid t = 1 - cos(pi/2 * tau), tau uniform on [0, 1] (n_timesteps + 1 points)."""
    tau = torch.linspace(0, 1, n_timesteps + 1, device=device, dtype=dtype)
    return 1 - torch.cos(tau * 0.5 * math.pi)
