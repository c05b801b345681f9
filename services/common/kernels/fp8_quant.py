"""e4m3 weights with per-output-channel scales, in torch only (no Triton): the quantizer and the reference.

The format and its kernel are described in :mod:`.fp8_gemm`; this half imports without Triton, so the
torch backend (CPU, tests, hosts without Triton) can round weights through fp8 too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


class Fp8Weight(NamedTuple):
    """An ``[N, K]`` weight as e4m3 values ``q`` and one fp32 scale per output row ``scale [N]``."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``q * scale`` as ``dtype`` (computed in fp32, rounded once)."""
        return (self.q.to(torch.float32) * self.scale[:, None]).to(dtype)


@torch.no_grad()
def quantize_fp8(weight: torch.Tensor, rows_per_chunk: int = 4096) -> Fp8Weight:
    """Per-output-channel e4m3 quantization of ``weight [N, K]`` (any float dtype), on its device.

    Processed ``rows_per_chunk`` rows at a time so the fp32 temporaries stay small beside a full-size
    model. An all-zero row gets scale 1 (its values are exact zeros either way).
    """
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    n = weight.shape[0]
    q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty(n, dtype=torch.float32, device=weight.device)
    for start in range(0, n, rows_per_chunk):
        w = weight[start : start + rows_per_chunk].to(torch.float32)
        s = w.abs().amax(dim=1) / FP8_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))
        q[start : start + rows_per_chunk] = (w / s[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        scale[start : start + rows_per_chunk] = s
    return Fp8Weight(q, scale)


def fp8_linear_ref(
    a: torch.Tensor,
    weight: Fp8Weight,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """What :func:`fp8_linear` computes, in torch: ``[residual +] (a @ q.T) * s (+ bias)`` in fp32,
    rounded once to ``a``'s dtype."""
    acc = (a.to(torch.float32) @ weight.q.to(torch.float32).t()) * weight.scale
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    if residual is not None:
        acc = acc + residual.to(torch.float32)
    return acc.to(a.dtype)


@dataclass(frozen=True)
class Fp8Layer:
    """One thinker decoder layer's four GEMM weights in e4m3 (the runner's fused layout: QKV, O, gate|up,
    down)."""

    qkv: Fp8Weight
    o: Fp8Weight
    gate_up: Fp8Weight
    down: Fp8Weight
