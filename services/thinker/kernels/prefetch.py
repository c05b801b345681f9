"""Whether and how the thinker's kernels may ask L2 to prefetch the next GEMM's weights.

A graphed decode step alternates bandwidth-bound GEMMs with latency-bound kernels (paged attention at
few rows reads ~2 MB in ~7 µs); during the latter HBM idles. The one-launch attention kernel
(:mod:`.rope_attention`) can meanwhile ask L2 to fetch the O projection's weight (32 MB, inside the H200's
50 MB L2), so the O GEMM that follows reads L2, not HBM. A prefetch changes no result, only timing.
"""

from __future__ import annotations

import os

import torch

L2_PREFETCH_ENV_VAR = "MINICPMO_THINKER_L2_PREFETCH"


def l2_prefetch_mode(device: torch.device) -> int:
    """0: no prefetch (CPU, the Triton interpreter, pre-Ampere GPUs, or ``MINICPMO_THINKER_L2_PREFETCH=0``);
    1: bulk prefetches (``cp.async.bulk.prefetch.L2``, sm_90 and later); 2: per-line prefetches (sm_80)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    if os.environ.get(L2_PREFETCH_ENV_VAR, "").strip() == "0":
        return 0
    major, _ = torch.cuda.get_device_capability(device)
    if major >= 9:
        return 1
    return 2 if major >= 8 else 0
