"""The thinker decoder layer's arithmetic in plain tensor functions, for the eager runner's torch path.

Split out of :mod:`services.thinker.runner` so the runner keeps only what it executes per step: these
are the per-layer pieces (fused weight layout, pre-/post-attention math) that the eager path calls and
``torch.compile`` can wrap, while the Triton path (:mod:`services.thinker.fused_forward`) replaces them
on CUDA. They take plain tensors, no modules, so one compiled graph serves every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.common.kernels import rms_norm_ref, rotate_ref


@dataclass
class FusedLayer:
    """One decoder layer's weights arranged for fewer kernels: QKV and gate|up as single GEMMs.

    The module's own parameters are re-pointed at views of the fused tensors, so no weight is stored
    twice and the transformers module (used by baselines and the fidelity dump) still works unchanged.
    """

    input_norm_weight: torch.Tensor
    input_eps: float
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    qk_norm_weight: torch.Tensor  # [Hq + Hkv, D]: q_norm rows then k_norm rows
    qk_eps: float
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm_weight: torch.Tensor
    post_eps: float
    gate_up_weight: torch.Tensor
    down_weight: torch.Tensor


def fuse_rows(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate output rows of several Linear layers and re-point each layer at its slice.

    Idempotent: a second runner over the same module finds the layers already pointing into one fused
    tensor and reuses it (no second copy of the weights, however many engines share the model).
    """
    fused = getattr(linears[0], "_thinker_fused", None)
    if fused is not None and all(getattr(lin, "_thinker_fused", None) is fused for lin in linears):
        weight, bias = fused
        start = 0
        intact = True
        for lin in linears:
            n = lin.weight.shape[0]
            intact &= lin.weight.data_ptr() == weight[start : start + n].data_ptr()
            start += n
        if intact:
            return weight, bias
    weight = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    has_bias = all(lin.bias is not None for lin in linears)
    bias = torch.cat([lin.bias.detach() for lin in linears]) if has_bias else None  # type: ignore[union-attr]
    start = 0
    record = (weight, bias)
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[start : start + n], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[start : start + n], requires_grad=False)
        lin._thinker_fused = record  # type: ignore[assignment]
        start += n
    return weight, bias


def fold_norm_weights(layer: nn.Module, fused: FusedLayer) -> bool:
    """Fold a decoder layer's two RMSNorm weights into the GEMMs that read the norms' outputs, in place.

    ``W @ (g * n(x)) == (W * g) @ n(x)``: the QKV columns take the input norm's weight and the gate|up
    columns the post-attention norm's; both norm weights become ones. The module (and the torch path)
    computes the same function afterwards, so no weight is stored twice, while the folded Triton loop
    (:mod:`services.thinker.fused_forward`) can then skip the norm kernels and scale the GEMM outputs by
    each row's ``1/RMS`` instead. Idempotent (a second runner over the same module finds it folded);
    returns whether this call folded. Layers with a QKV or O bias are left alone (their bias would have
    to be added after the scale; Qwen3 has none): the caller checks :func:`foldable`.
    """
    if getattr(layer, "_thinker_norms_folded", False):
        return False
    with torch.no_grad():
        fused.qkv_weight.mul_(layer.input_layernorm.weight[None, :])
        fused.gate_up_weight.mul_(layer.post_attention_layernorm.weight[None, :])
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
    layer._thinker_norms_folded = True  # type: ignore[assignment]
    return True


def foldable(fused: FusedLayer) -> bool:
    """Whether the folded layer loop computes this layer: no bias on the QKV and O projections."""
    return fused.qkv_bias is None and fused.o_bias is None


_rms_norm = rms_norm_ref
_rotate = rotate_ref


def pre_attention(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    qk_norm_weight: torch.Tensor,
    qk_eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    hq: int,
    hkv: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input norm, fused QKV, q/k norms in one pass, rotary over q and k heads: ``(q, k, v)``.

    Plain tensors in, tensors out (no module or dataclass), so one compiled graph serves every layer.
    """
    t = x.shape[0]
    d = qk_norm_weight.shape[-1]
    qkv = F.linear(_rms_norm(x, norm_weight, norm_eps), qkv_weight, qkv_bias)
    qk = qkv[:, : (hq + hkv) * d].reshape(t, hq + hkv, d)
    v = qkv[:, (hq + hkv) * d :].reshape(t, hkv, d)
    qk = _rotate(_rms_norm(qk, qk_norm_weight, qk_eps), cos, sin)
    return qk[:, :hq], qk[:, hq:], v


def post_attention(
    x: torch.Tensor,
    o: torch.Tensor,
    o_weight: torch.Tensor,
    o_bias: torch.Tensor | None,
    norm_weight: torch.Tensor,
    norm_eps: float,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
) -> torch.Tensor:
    """Output projection + residual, then the SwiGLU MLP (fused gate|up) + residual."""
    x = x + F.linear(o, o_weight, o_bias)
    gate, up = F.linear(_rms_norm(x, norm_weight, norm_eps), gate_up_weight).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, down_weight)
