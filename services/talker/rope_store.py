"""Triton kernel of the talker decode step: rotary on q and k plus the K/V store, in one launch.

Why its own kernel: the thinker's ``qk_rope_store`` also applies Qwen3's per-head q/k RMSNorm, which the
talker's Llama backbone does not have. Everything else follows the thinker's conventions, so the fused
step can reuse the thinker's norm, SwiGLU and paged-attention kernels on the same cache layout.

Rounding follows the torch path of :mod:`services.talker.runner` to the bit: ``x·cos`` and
``roll(x)·sin_signed`` each round to the activation dtype, then their sum rounds once (the sign of
``rotate_half`` lives in the ``sin_signed`` table, exactly as in the torch path). Imported lazily: only
when the Triton backend is selected.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "tok_ptr"])
def _rope_store_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    tok_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    half: tl.constexpr = D // 2
    offs = tl.arange(0, D)
    width: tl.constexpr = (HQ + 2 * HKV) * D
    base = qkv_ptr + t * width + h * D
    x = tl.load(base + offs)
    tok = tl.load(tok_ptr + t).to(tl.int64)
    if h < HQ + HKV:
        xp = tl.load(base + (offs + half) % D).to(tl.float32)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        c = tl.load(cos_ptr + pos * D + offs).to(tl.float32)
        s = tl.load(sin_ptr + pos * D + offs).to(tl.float32)
        a = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
        b = (xp * s).to(x.dtype).to(tl.float32)
        out = (a + b).to(x.dtype)
        if h < HQ:
            tl.store(q_ptr + (t * HQ + h) * D + offs, out)
        else:
            tl.store(k_ptr + (tok * HKV + (h - HQ)) * D + offs, out)
    else:
        tl.store(v_ptr + (tok * HKV + (h - HQ - HKV)) * D + offs, x)


def rope_store(
    qkv: torch.Tensor,
    cos_table: torch.Tensor,
    sin_signed_table: torch.Tensor,
    positions: torch.Tensor,
    tokens: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    hq: int,
    hkv: int,
) -> torch.Tensor:
    """Rotate q and k of packed ``qkv [T, (hq+2hkv)·D]`` at ``positions``; K/V go to cache row ``tokens``.

    ``k_cache``/``v_cache`` are one layer's ``[slots, context + 1, hkv, D]`` (contiguous), addressed as
    flat token rows ``slot·(context + 1) + index``. Returns q ``[T, hq, D]``.
    """
    t = qkv.shape[0]
    d = cos_table.shape[-1]
    q = torch.empty((t, hq, d), dtype=qkv.dtype, device=qkv.device)
    _rope_store_kernel[(t, hq + 2 * hkv)](
        qkv,
        cos_table,
        sin_signed_table,
        positions,
        tokens,
        q,
        k_cache,
        v_cache,
        HQ=hq,
        HKV=hkv,
        D=d,
        num_warps=1,
    )
    return q
