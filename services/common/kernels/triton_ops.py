"""Triton kernels of the fused decoder layers (see :mod:`services.common.kernels` for why and what).

Every kernel reproduces the rounding points of the torch reference where the reference rounds to the
activation dtype (RMSNorm output before the weight, each rotary product, the residual sum), so norms,
rotary and the gate match the reference to the last bit or one ulp; attention accumulates in fp32 with
an online softmax (flash-attention order), which differs from SDPA only by fp32 summation order and
the bf16 rounding of the probabilities before the P·V product.

Launch shapes are fixed by the tensors' shapes and ``AttentionTiles`` (no host reads of device data),
so every wrapper is safe inside a CUDA-graph capture. Arguments that vary from step to step (row counts,
block-table widths, the alignment of tile-metadata views) are excluded from Triton's specialisation, so a
new step shape never triggers a JIT compile while serving (a compile takes hundreds of milliseconds and
stalls every stream); :meth:`ModelRunner.warmup_graphs` compiles the eager variant at start-up.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from services.common.kernels.counters import ArrivalCounters, split_scratch
from services.common.kernels.rope_attention import rope_attention
from services.common.kernels.tiles import AttentionTiles
from services.common.kernels.triton_parts import (
    attend_pages,
    norm_rope_tile,
    row_inv_rms,
    to_cache,
    write_output,
)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
def _add_rms_norm_kernel(  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    x_ptr, d_ptr, w_ptr, xo_ptr, y_ptr, n_cols, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=m, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * n_cols + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(xo_ptr.dtype.element_ty)
        tl.store(xo_ptr + row * n_cols + cols, x, mask=m)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    hn = (h * (1.0 / tl.sqrt(var + eps))).to(y_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=m, other=0.0)
    y = (w.to(tl.float32) * hn.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * n_cols + cols, y, mask=m)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
def _silu_mul_kernel(  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    gu_ptr,
    out_ptr,
    x_ptr,
    x_eps,
    n_cols,
    BLOCK: tl.constexpr,
    SCALED: tl.constexpr,
    HIDDEN: tl.constexpr,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n_cols
    gate = tl.load(gu_ptr + row * 2 * n_cols + cols, mask=m, other=0.0)
    up = tl.load(gu_ptr + row * 2 * n_cols + n_cols + cols, mask=m, other=0.0)
    if SCALED:  # the post-attention norm folded into gate|up: scale by the residual row's 1/RMS first
        inv = row_inv_rms(x_ptr, row, x_eps, HIDDEN, CHUNK)
        gate = (gate.to(tl.float32) * inv).to(gate.dtype)
        up = (up.to(tl.float32) * inv).to(up.dtype)
    gf = gate.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(out_ptr.dtype.element_ty)
    tl.store(
        out_ptr + row * n_cols + cols,
        (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
        mask=m,
    )


@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])  # type: ignore[untyped-decorator]  # triton ships no type information
def _qk_rope_store_kernel(  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    qkv_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    eps,
    x_ptr,
    x_eps,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    SCALED: tl.constexpr,
    HIDDEN: tl.constexpr,
    CHUNK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    half: tl.constexpr = D // 2
    offs = tl.arange(0, D)[None, :]  # one head as a [1, D] tile (norm_rope_tile works on tiles of heads)
    width: tl.constexpr = (HQ + 2 * HKV) * D
    base = qkv_ptr + t * width + h * D
    x = tl.load(base + offs)
    inv_x = 1.0
    if SCALED:  # the input norm folded into the QKV GEMM: scale by the residual row's 1/RMS first
        inv_x = row_inv_rms(x_ptr, t, x_eps, HIDDEN, CHUNK)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if h < HQ + HKV:
        partner = (offs + half) % D
        xp = tl.load(base + partner)
        w = 0.0
        wp = 0.0
        if HAS_NORM:
            w = tl.load(w_ptr + h * D + offs).to(tl.float32)
            wp = tl.load(w_ptr + h * D + partner).to(tl.float32)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        c = tl.load(cos_ptr + pos * D + offs).to(tl.float32)
        s = tl.load(sin_ptr + pos * D + offs).to(tl.float32)
        out = norm_rope_tile(x, xp, inv_x, w, wp, c, s, eps, offs < half, SCALED, HAS_NORM, D)
        if h < HQ:
            tl.store(q_ptr + (t * HQ + h) * D + offs, out)
        else:
            tl.store(k_ptr + (slot * HKV + (h - HQ)) * D + offs, to_cache(out, k_ptr))
    else:
        if SCALED:
            x = (x.to(tl.float32) * inv_x).to(x.dtype)
        tl.store(v_ptr + (slot * HKV + (h - HQ - HKV)) * D + offs, to_cache(x, v_ptr))


@triton.jit(  # type: ignore[untyped-decorator]  # triton ships no type information
    do_not_specialize=["table_stride", "n_rows"],
    do_not_specialize_on_alignment=["row_ptr", "len_ptr", "seq_ptr", "pos_ptr", "table_ptr"],
)
def _paged_attention_kernel(  # type: ignore[no-untyped-def]  # Triton DSL: annotations steer its specialisation
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    po_ptr,
    pm_ptr,
    pl_ptr,
    cnt_ptr,
    row_ptr,
    len_ptr,
    seq_ptr,
    pos_ptr,
    table_ptr,
    table_stride,
    n_rows,
    scale_log2,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One (tile, KV head, key split) program: online-softmax attention over the tile's paged keys, then,
    for split-K, the last split to arrive merges every split's partial result (:mod:`.triton_parts`)."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row0 = tl.load(row_ptr + tile).to(tl.int64)
    n = tl.load(len_ptr + tile)
    seq = tl.load(seq_ptr + tile).to(tl.int64)
    p0 = tl.load(pos_ptr + tile)
    m_idx = tl.arange(0, BLOCK_M)
    t_idx = m_idx // G
    g_idx = m_idx % G
    m_valid = (t_idx < n) & (t_idx < BLOCK_T)
    d_idx = tl.arange(0, D)
    q_rows = row0 + t_idx
    head = kvh * G + g_idx
    q = tl.load(
        q_ptr + ((q_rows * HQ + head) * D)[:, None] + d_idx[None, :], mask=m_valid[:, None], other=0.0
    )
    total = p0 + n
    per = tl.cdiv(tl.cdiv(total, SPLITS), BLOCK_N) * BLOCK_N
    start = split * per
    end = tl.minimum(total, start + per)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    m_i, l_i, acc = attend_pages(
        q, m_i, l_i, acc, table_ptr + seq * table_stride, start, end, p0 + t_idx, k_ptr, v_ptr, kvh,
        scale_log2, HKV, D, PAGE, BLOCK_N, IEEE, False,
    )  # fmt: skip
    write_output(
        acc, m_i, l_i, o_ptr, po_ptr, pm_ptr, pl_ptr, cnt_ptr + tile * HKV + kvh, q_rows, head, m_valid,
        split, n_rows, HQ, D, SPLITS,
    )  # fmt: skip


_COUNTERS = ArrivalCounters("split counters")  # the split-K merge of paged attention


def _chunk(hidden: int) -> int:
    """Columns per load of :func:`_row_inv_rms`: the row in a few wide loads, at most 1024 per load."""
    width: int = min(1024, triton.next_power_of_2(hidden))
    return width


class TritonOps:
    """The fused operations as Triton kernels (same signatures as :class:`~.TorchOps`)."""

    name = "triton"
    rope_attention = staticmethod(rope_attention)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y = torch.empty_like(x)
        n = x.shape[-1]
        _add_rms_norm_kernel[(x.numel() // n,)](
            x, x, weight, x, y, n, eps, HAS_DELTA=False, BLOCK=triton.next_power_of_2(n), num_warps=8
        )
        return y

    @staticmethod
    def add_rms_norm(
        x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = torch.empty_like(x)
        y = torch.empty_like(x)
        n = x.shape[-1]
        _add_rms_norm_kernel[(x.numel() // n,)](
            x, delta, weight, s, y, n, eps, HAS_DELTA=True, BLOCK=triton.next_power_of_2(n), num_warps=8
        )
        return s, y

    @staticmethod
    def silu_mul(gate_up: torch.Tensor, rms_of: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        t, two_i = gate_up.shape
        n = two_i // 2
        out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
        block = min(2048, triton.next_power_of_2(n))
        x, x_eps = rms_of if rms_of is not None else (gate_up, 0.0)
        hidden = x.shape[-1] if rms_of is not None else 1
        _silu_mul_kernel[(t, triton.cdiv(n, block))](
            gate_up, out, x, x_eps, n, BLOCK=block, SCALED=rms_of is not None, HIDDEN=hidden,
            CHUNK=_chunk(hidden), num_warps=4,
        )  # fmt: skip
        return out

    @staticmethod
    def qk_rope_store(
        qkv: torch.Tensor,
        qk_norm_weight: torch.Tensor | None,
        eps: float,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        hq: int,
        hkv: int,
        rms_of: tuple[torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        t = qkv.shape[0]
        d = cos_table.shape[-1]
        q = torch.empty((t, hq, d), dtype=qkv.dtype, device=qkv.device)
        x, x_eps = rms_of if rms_of is not None else (qkv, 0.0)
        hidden = x.shape[-1] if rms_of is not None else 1
        _qk_rope_store_kernel[(t, hq + 2 * hkv)](
            qkv,
            qkv if qk_norm_weight is None else qk_norm_weight,
            cos_table,
            sin_table,
            positions,
            write_slots,
            q,
            k_cache,
            v_cache,
            eps,
            x,
            x_eps,
            HQ=hq,
            HKV=hkv,
            D=d,
            HAS_NORM=qk_norm_weight is not None,
            SCALED=rms_of is not None,
            HIDDEN=hidden,
            CHUNK=_chunk(hidden),
            num_warps=1,
        )
        return q

    @staticmethod
    def paged_attention(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tiles: AttentionTiles,
        launch: tuple[int, int, int] | None = None,
    ) -> torch.Tensor:
        """``launch``: ``(BLOCK_N, num_warps, num_stages)`` instead of the default (the microbench's sweep,
        ``python -m bench.thinker.attention --sweep``)."""
        t, hq, d = q.shape
        hkv = k_cache.shape[1]
        g = hq // hkv
        out = torch.empty_like(q)
        block_m = max(16, triton.next_power_of_2(tiles.block_t * g))
        # One-row tiles (every graphed step): a two-stage key pipeline. Measured on the H200 with
        # ``bench.thinker.attention --sweep`` against Triton's default of three stages, per layer at 16
        # rows: 15.3 -> 10.8 µs (context 512), 28.2 -> 23.1 µs (1024); at 1 row 5.5 -> 5.2 µs. Prefill
        # tiles keep the default (not swept).
        block_n, warps, stages = launch or ((64, 4, 2) if tiles.block_t == 1 else (64, 4, None))
        splits = tiles.splits
        n_tiles = tiles.row.shape[0]
        po, pm, pl, counters = split_scratch(_COUNTERS, out, splits, n_tiles * hkv)
        _paged_attention_kernel[(n_tiles, hkv, splits)](
            q,
            k_cache,
            v_cache,
            out,
            po,
            pm,
            pl,
            counters,
            tiles.row,
            tiles.length,
            tiles.seq,
            tiles.pos,
            tiles.table,
            tiles.table.stride(0),
            t,
            (1.0 / math.sqrt(d)) * 1.4426950408889634,
            HQ=hq,
            HKV=hkv,
            G=g,
            D=d,
            PAGE=tiles.page_size,
            BLOCK_T=tiles.block_t,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            SPLITS=splits,
            IEEE=q.dtype == torch.float32,
            num_warps=warps,
            **({} if stages is None else {"num_stages": stages}),
        )
        return out
