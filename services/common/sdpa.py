"""Scaled-dot-product attention for eager paths whose shapes change from call to call.

Why: with torch's default backend choice, an SDPA call on the H200 may take cuDNN attention, which
builds an execution plan the first time it sees a (batch, rows, keys) shape: 60 ms per new shape, up to
1.5 s for the first (``bench/gpu/sdpa_probe.py``; BENCHMARKS.md, "SDPA first-call cost per shape"). The talker's prefill shapes change
with every burst, so each burst paid it; the audio encoder's streaming caches grow with every chunk.
Flash and memory-efficient attention need no plan, so these paths allow only them (and the math
fallback, which always applies). Graph-captured calls with fixed shapes are unaffected either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` restricted to :data:`SDPA_BACKENDS` (never cuDNN attention)."""
    with sdpa_kernel(SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)
